"""Would a tensor-core Triton GEMM for a few rows (a decode step of 9-16 requests) beat cuBLAS, with or without
programmatic dependent launch (PDL)?

At 16 requests the decode step's linears run on cuBLAS (our one-row GEMV serves batch 1; the CUDA-core few-row
GEMV of ``rows_gemv.py`` lost to cuBLAS at 2-8 rows); a 4B step of 16 is 1.56x its HBM floor on an H100, against
1.33x at one request, where PDL for our kernels took 5 % off (``results/h100_20261206e``). Here one program
multiplies all M rows (padded to 16, a tensor-core dot's least side) by a BLOCK_N x K weight tile: ``tl.dot`` of
[16, BLOCK_K] by [BLOCK_K, BLOCK_N] chunks, fp32 accumulation, the output rounded once. Per linear of the 4B shape
(gate_up without SiLU-and-mul) and M, 36 weight copies are multiplied in one CUDA graph per variant (the weights
stream from HBM as in a step; consecutive launches, so PDL can overlap one product's tail with the next one's
start), against ``F.linear``; every tile is first checked against a float64 product.

    python benchmarks/probes/rows_gemm_tc.py --out $OUT

On CPU with triton installed, ``TRITON_INTERPRET=1 python benchmarks/probes/rows_gemm_tc.py --check-only`` runs the
float64 checks on small shapes (the interpreter has no PDL: those tiles run without it).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from optional_triton import jit, require_triton, tl, triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (BLOCK_N, BLOCK_K, num_warps, num_stages, PDL)
TILES = list(itertools.product((16, 32, 64, 128), (128, 256, 512), (4,), (3, 4), (False, True)))
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@jit
def _rows_tc_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    # program p: output columns [p * BLOCK_N, (p + 1) * BLOCK_N) of every row
    if PDL:
        tl.extra.cuda.gdc_wait()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(x, w, acc, input_precision="ieee" if x.dtype == tl.float32 else "tf32")
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def rows_tc_linear(x: torch.Tensor, w: torch.Tensor, tile) -> torch.Tensor:
    """x [M <= 16, K] @ w [N, K].T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, warps, stages, pdl = tile
    pdl = pdl and not INTERPRETED
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _rows_tc_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, m, n, k, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return y


def check_only() -> None:
    """The float64 check on small shapes (any device; under the interpreter on CPU)."""
    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    for m, n, k in ((16, 96, 200), (13, 64, 256), (1, 40, 130)):
        x = torch.randn(m, k, generator=g, device=device)
        w = torch.randn(n, k, generator=g, device=device) * k**-0.5
        want = x.double() @ w.double().T
        for tile in ((16, 256, 4, 3, False), (32, 128, 4, 3, False), (64, 64, 4, 3, True)):
            got = rows_tc_linear(x, w, tile)
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err < 1e-5, (m, n, k, tile, err)
            print(f"m={m} n={n} k={k} {tile}: rel err {err:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="16,8,2")
    p.add_argument("--copies", type=int, default=36)
    p.add_argument("--check-only", action="store_true", help="the float64 checks on small shapes, then stop")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    name = Path(__file__).name
    if not torch.cuda.is_available() and not (args.check_only and INTERPRETED):
        sys.exit(f"{name} is a CUDA probe (Triton kernels against cuBLAS): no CUDA device here (its checks on CPU, "
                 "with triton installed: TRITON_INTERPRET=1 ... --check-only)")  # fmt: skip
    require_triton(__file__, interpreter_checks=True)
    torch.set_grad_enabled(False)
    if args.check_only:
        check_only()
        return
    from blas import per_product_us, shapes
    from common import ResultFile, environment

    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name, (n_out, n_in) in shapes().items():
        weights = [(torch.randn(n_out, n_in, generator=g, device="cuda") * n_in**-0.5).bfloat16()
                   for _ in range(args.copies)]  # fmt: skip
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, n_in, generator=g, device="cuda").bfloat16()
            want = x.double() @ weights[0].double().T
            base = per_product_us(lambda x=x, ws=weights: [F.linear(x, w) for w in ws], args.copies)
            best = {}
            for tile in TILES:
                try:
                    got = rows_tc_linear(x, weights[0], tile)
                    err = ((got.double() - want).norm() / want.norm()).item()
                    us = per_product_us(lambda x=x, t=tile, ws=weights: [rows_tc_linear(x, w, t) for w in ws],
                                        args.copies)  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is recorded and skipped
                    print(f"{name} m={m} {tile}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                results.append({"linear": name, "m": m, "tile": list(tile), "us": us, "rel_err": err,
                                "cublas_us": base})  # fmt: skip
                if err < 1e-2 and (tile[4] not in best or us < best[tile[4]][0]):
                    best[tile[4]] = (us, tile, err)
            for pdl, (us, tile, err) in sorted(best.items()):
                print(f"{name:8s} m={m:2d} pdl={pdl!s:5s}: cuBLAS {base:7.2f} us, best triton {us:7.2f} us {tile} "
                      f"({base / us:.3f}x) err {err:.1e}", flush=True)  # fmt: skip
    if args.out:
        result = ResultFile(args.out, "rows_gemm_tc", environment(torch.device("cuda"), "probes/rows_gemm_tc.py", None))
        result.set("rows", results)
        print(f"wrote {result.path}")


if __name__ == "__main__":
    main()
