"""The decode step's four linears (4B shape, bf16) under torch's two BLAS back ends, and at one row the same
product with the operands swapped.

CUDA only. For each linear (qkv, o_proj, gate_up, down) and M rows (default 1, 4, 16, 64): 36 distinct weight
copies (as many as layers, so weights stream from HBM, not L2) are multiplied in one CUDA graph, captured
once per variant; the figure is the median replay time per product and the weight bandwidth it implies.
Results are checked against each other (same products). Variants: ``cublas`` and ``cublaslt``
(``F.linear`` under ``torch.backends.cuda.preferred_blas_library``), and at M = 1 ``swapped`` (``W @ x^T``,
which cuBLAS sees as a matrix-vector product with the weight as the left operand) and ``mv`` (``torch.mv``).

    python benchmarks/probes/blas.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode import SHAPE_4B  # noqa: E402

from higgs_talker.cuda_graphs.capture import capture_graph, median_ms  # noqa: E402


def shapes() -> dict[str, tuple[int, int]]:
    h, i = SHAPE_4B["hidden_size"], SHAPE_4B["intermediate_size"]
    q = SHAPE_4B["num_attention_heads"] * SHAPE_4B["head_dim"]
    kv = SHAPE_4B["num_key_value_heads"] * SHAPE_4B["head_dim"]
    return {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


PRODUCTS = {
    "cublas": lambda x, w: F.linear(x, w),
    "cublaslt": lambda x, w: F.linear(x, w),
    "swapped": lambda x, w: torch.mm(w, x.t()).view(1, -1),
    "mv": lambda x, w: torch.mv(w, x[0]).view(1, -1),
}


def per_product_us(run, products: int) -> float:
    """Microseconds per product of ``run()`` (which makes ``products`` of them), captured in one CUDA graph: the
    median of 7 timings of 5 replays (the probes' common timer)."""
    graph, _ = capture_graph(run)
    return median_ms(lambda: [graph.replay() for _ in range(5)], iters=7) * 1e3 / (5 * products)


def time_backend(variant: str, weights: list[torch.Tensor], x: torch.Tensor) -> tuple[float, torch.Tensor]:
    torch.backends.cuda.preferred_blas_library("cublaslt" if variant == "cublaslt" else "cublas")
    product = PRODUCTS[variant]
    outs = [None] * len(weights)

    def run() -> None:
        for n, w in enumerate(weights):
            outs[n] = product(x, w)

    return per_product_us(run, len(weights)), outs[0].clone()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--copies", type=int, default=36)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe: no CUDA device here")
    torch.set_grad_enabled(False)
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name, (n_out, n_in) in shapes().items():
        weights = [torch.randn(n_out, n_in, generator=g, device="cuda").bfloat16() for _ in range(args.copies)]
        nbytes = n_out * n_in * 2
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, n_in, generator=g, device="cuda").bfloat16()
            row = {"linear": name, "m": m, "weight_mb": nbytes / 1e6}
            ref = None
            variants = ("cublas", "cublaslt", "swapped", "mv") if m == 1 else ("cublas", "cublaslt")
            for backend in variants:
                us, out = time_backend(backend, weights, x)
                ref = out if ref is None else ref
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row[f"{backend}_us"], row[f"{backend}_rel_diff"] = us, err
                row[f"{backend}_tb_per_s"] = nbytes / us / 1e6
            results.append(row)
            timings = "  ".join(
                f"{v} {row[f'{v}_us']:7.2f} us ({row[f'{v}_tb_per_s']:.2f} TB/s, diff {row[f'{v}_rel_diff']:.1e})"
                for v in variants
            )
            print(f"{name:8s} M={m:<3d} {row['weight_mb']:6.1f} MB  {timings}", flush=True)
        del weights
        torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    if args.out:
        path = Path(args.out) / f"blas_probe_{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": results}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
