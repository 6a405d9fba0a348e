"""Would a few-row Triton GEMV beat cuBLAS at 2-8 rows, as the one-row one does at one?

CUDA only. The library's one-row kernel (``higgs_talker.triton_gemv``) reads each weight tile once per row it
serves; here one program multiplies its weight tile by all M rows (M a power of two), either keeping an
[M, BLOCK_N, BLOCK_K] accumulator and reducing once (``reduce=0``) or reducing each K chunk into [M, BLOCK_N]
(``reduce=1``: fewer registers). Per linear of the 4B shape (gate_up without SiLU-and-mul) and M, 36 weight copies
are multiplied in one CUDA graph per variant, against ``F.linear`` (cuBLAS); each tile is checked against float64.

    python benchmarks/probes/rows_gemv.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from optional_triton import jit, require_triton, tl, triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from blas import per_product_us, shapes  # noqa: E402
from common import ResultFile, environment  # noqa: E402

# (BLOCK_N, BLOCK_K, num_warps, num_stages, reduce each chunk)
TILES = list(itertools.product((1, 2), (512, 1024), (2, 4), (2,), (0, 1)))


@jit
def _rows_kernel(x_ptr, w_ptr, y_ptr, N, K, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 REDUCE_EACH: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    m = tl.arange(0, M)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    acc = tl.zeros([M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(x_ptr + m[:, None] * K + cols[None, :], mask=col_ok[None, :], other=0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0).to(tl.float32)
        if REDUCE_EACH:
            acc2 += tl.sum(w[None, :, :] * x[:, None, :], axis=2)
        else:
            acc += w[None, :, :] * x[:, None, :]
    if REDUCE_EACH:  # noqa: SIM108 - an if on a constexpr, resolved when Triton compiles
        y = acc2
    else:
        y = tl.sum(acc, axis=2)
    tl.store(y_ptr + m[:, None] * N + rows[None, :], y.to(y_ptr.dtype.element_ty), mask=row_ok[None, :])


def rows_linear(x: torch.Tensor, w: torch.Tensor, tile) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, warps, stages, reduce_each = tile
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _rows_kernel[(triton.cdiv(n, block_n),)](x, w, y, n, k, M=m, BLOCK_N=block_n, BLOCK_K=block_k,
                                             REDUCE_EACH=reduce_each, num_warps=warps, num_stages=stages)  # fmt: skip
    return y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="2,4,8")
    p.add_argument("--copies", type=int, default=36)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe (Triton kernels against cuBLAS): no CUDA device here")
    require_triton(__file__)
    torch.set_grad_enabled(False)
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name, (n_out, n_in) in shapes().items():
        weights = [(torch.randn(n_out, n_in, generator=g, device="cuda") * n_in**-0.5).bfloat16()
                   for _ in range(args.copies)]  # fmt: skip
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, n_in, generator=g, device="cuda").bfloat16()
            want = x.double() @ weights[0].double().T
            base = per_product_us(lambda x=x, ws=weights: [F.linear(x, w) for w in ws], args.copies)
            best = None
            for tile in TILES:
                try:
                    got = rows_linear(x, weights[0], tile)
                    err = ((got.double() - want).norm() / want.norm()).item()
                    us = per_product_us(lambda x=x, t=tile, ws=weights: [rows_linear(x, w, t) for w in ws], args.copies)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is recorded and skipped
                    print(f"{name} m={m} {tile}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                results.append({"linear": name, "m": m, "tile": list(tile), "us": us, "rel_err": err,
                                "cublas_us": base})  # fmt: skip
                if best is None or us < best[0]:
                    best = (us, tile, err)
            if best:
                print(f"{name:8s} m={m}: cuBLAS {base:7.2f} us, best triton {best[0]:7.2f} us {best[1]} "
                      f"({base / best[0]:.3f}x) err {best[2]:.1e}", flush=True)  # fmt: skip
    if args.out:
        result = ResultFile(args.out, "rows_gemv", environment(torch.device("cuda"), "probes/rows_gemv.py", None))
        result.set("rows", results)
        print(f"wrote {result.path}")


if __name__ == "__main__":
    main()
