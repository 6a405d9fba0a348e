"""Host time of the local MLP graphs' per-layer hook (``cuda_graphs.local_mlp``) in an eager step, where the host
bounds the step (vLLM's enforce_eager profile; our ``local_mlp`` graph mode): the bucket and the run-time guard
settled at every layer (``post_attention_or_eager``) against once a forward (``step_hook``), and the bare
static-input copies + replay beside them. The graphs are stand-ins whose replay does nothing, so the figures are
the hook's own host time (on CUDA the copies are launched, not waited for).

    python benchmarks/probes/local_mlp_host.py                        # CPU, the 4B shape's 36 layers
    python benchmarks/probes/local_mlp_host.py --device cuda --out $OUT
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import ResultFile, environment, ints_arg, resolve_device  # noqa: E402

from higgs_talker.cuda_graphs.buckets import DEFAULT_BUCKETS  # noqa: E402
from higgs_talker.cuda_graphs.local_mlp import LocalMLPGraphs, _Bucket  # noqa: E402


class _NoReplay:
    def replay(self) -> None:
        pass


def _graphs(layers: int, hidden: int, dtype: torch.dtype, device: torch.device) -> LocalMLPGraphs:
    graphs = LocalMLPGraphs(lambda i, h, r: (h, r), layers, DEFAULT_BUCKETS, forward_context=lambda: None)
    for size in DEFAULT_BUCKETS:
        bucket = _Bucket(size, hidden, dtype, device)
        bucket.graphs = [_NoReplay() for _ in range(layers)]
        graphs.buckets[size] = bucket
    return graphs


def _us_per_forward(fn, repeats: int) -> float:
    """Median over ``repeats`` rounds of 20 calls, microseconds per call (after 200 untimed calls)."""
    for _ in range(200):
        fn()
    rounds = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(20):
            fn()
        rounds.append((time.perf_counter() - t) / 20 * 1e6)
    return statistics.median(rounds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--batches", type=ints_arg, default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    graphs = _graphs(args.layers, args.hidden, torch.bfloat16, device)
    rows = []
    for batch in args.batches:
        hidden = torch.randn(batch, args.hidden, device=device).bfloat16()
        residual = torch.randn(batch, args.hidden, device=device).bfloat16()
        bucket = graphs.buckets[min(b for b in graphs.buckets if b >= batch)]
        views = bucket.views(batch)

        def per_layer(h=hidden, r=residual):
            for i in range(args.layers):
                graphs.post_attention_or_eager(i, h, r)

        def per_step(h=hidden, r=residual, b=batch):
            hook = graphs.step_hook(b)
            for i in range(args.layers):
                hook(i, h, r)

        def bare(h=hidden, r=residual, v=views, g=bucket.graphs):
            for i in range(args.layers):
                v[0].copy_(h)
                v[1].copy_(r)
                g[i].replay()

        with torch.inference_mode():
            row = {"batch": batch, "layers": args.layers}
            for name, fn in (("per_layer_us", per_layer), ("per_step_us", per_step), ("bare_us", bare)):
                row[name] = _us_per_forward(fn, args.repeats)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append(row)
        print(f"batch {batch:3d}: settled per layer {row['per_layer_us']:7.1f} us a forward, once a forward "
              f"{row['per_step_us']:7.1f} us, copies + replay alone {row['bare_us']:7.1f} us "
              f"({args.layers} layers)", flush=True)  # fmt: skip
    if args.out:
        result = ResultFile(args.out, "local_mlp_host", environment(device, "probes/local_mlp_host.py", argv))
        result.set("rows", rows)
        print(f"wrote {result.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
