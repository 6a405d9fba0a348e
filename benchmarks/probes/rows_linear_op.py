"""Probe: ``torch.ops.higgs_talker.rows_linear`` (``higgs_talker.row_linear_op``) on a GPU, as vLLM would run it.

The 4B shape's four linears of each of 36 layers (random bf16 weights), their tiles measured by
``row_linear_op.choose_tiles``; then the 144 products of one decode step's linears, at 1 and 16 rows:
``F.linear`` replayed from a CUDA graph against the op traced by ``torch.compile`` (Inductor, fullgraph, one trace
for both row counts) and replayed from a CUDA graph. Each op result is checked against ``F.linear``'s (relative
norm of the difference within a few bf16 roundings). Then, at 1, 16 and 64 rows, the same 144 products called
eagerly, without a graph, ``F.linear`` against the op (64 rows: the op's own ``F.linear``), which is how vLLM runs
the steps its graphs do not hold (prefills, mixed steps): the difference is the op's dispatch on the host where the
host is the bound. Writes ``rows_linear_op_<time>.json`` under ``--out``.

    python benchmarks/probes/rows_linear_op.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from higgs_talker import row_linear_op
from higgs_talker.cuda_graphs.capture import capture_graph, median_ms

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 2560, 9728, 32, 8, 128, 36


def linear(n: int, k: int, gen: torch.Generator) -> SimpleNamespace:
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.float32).mul_(k**-0.5).to(torch.bfloat16)
    return SimpleNamespace(weight=w, bias=None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=LAYERS)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [SimpleNamespace(
        self_attn=SimpleNamespace(qkv_proj=linear((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, gen),
                                  o_proj=linear(HIDDEN, HEADS * HEAD_DIM, gen)),
        mlp=SimpleNamespace(gate_up_proj=linear(2 * INTER, HIDDEN, gen), down_proj=linear(HIDDEN, INTER, gen)),
    ) for _ in range(args.layers)]  # fmt: skip
    t0 = time.perf_counter()
    choice_rows = row_linear_op.choose_tiles(layers)
    tiles = {str(k): v for k, v in row_linear_op.TILES.items()}
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
            "choose_s": time.perf_counter() - t0, "tiles": tiles}  # fmt: skip
    print(json.dumps(meta), flush=True)
    weights = [m.weight for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                       layer.mlp.gate_up_proj, layer.mlp.down_proj)]  # fmt: skip

    def products(linear_fn, xs):  # each layer's four linears on fixed inputs (weights stream as in a step)
        return [linear_fn(xs[w.shape[1]], w) for w in weights]

    widths = {w.shape[1] for w in weights}

    def inputs(m: int) -> dict[int, torch.Tensor]:  # m random rows for each input width
        return {k: torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16) for k in widths}

    compiled = torch.compile(lambda xs: products(torch.ops.higgs_talker.rows_linear, xs), fullgraph=True)
    rows = []
    for m in (1, 16):
        xs = inputs(m)
        for path, fn in (("F.linear", lambda xs=xs: products(F.linear, xs)),
                         ("op eager", lambda xs=xs: products(torch.ops.higgs_talker.rows_linear, xs)),
                         ("op compiled", lambda xs=xs: compiled(xs))):  # fmt: skip
            row = {"rows": m, "path": path}
            try:
                graph, out = capture_graph(fn)
                graph.replay()
                want = products(F.linear, xs)
                torch.cuda.synchronize()
                row["max_rel_err"] = max(((o.float() - w.float()).norm() / w.float().norm()).item()
                                         for o, w in zip(out, want, strict=True))  # fmt: skip
                row["us_per_step"] = median_ms(graph.replay, iters=20, warmup=3) * 1e3
            except Exception as exc:  # noqa: BLE001 - a path that fails is written down
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            rows.append(row)
            print(json.dumps(row), flush=True)
    for m in (1, 16, 64):  # eager, no graph: CUDA events around the launches of one step's 144 products
        xs = inputs(m)
        for path, fn in (("F.linear no graph", lambda xs=xs: products(F.linear, xs)),
                         ("op no graph", lambda xs=xs: products(torch.ops.higgs_talker.rows_linear, xs))):  # fmt: skip
            row = {"rows": m, "path": path, "us_per_step": median_ms(fn, iters=50, warmup=5) * 1e3}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rows_linear_op_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"meta": meta, "choices": choice_rows, "rows": rows}, indent=1, default=str))
    print(path)


if __name__ == "__main__":
    main()
