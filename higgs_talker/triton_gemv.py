"""Linears of one and of a few rows in Triton: ``y = x @ W.T (+ b)``, and gate_up with SiLU-and-mul after it.

At batch 1 a decode step multiplies one row by every weight of the model, so each linear is a weight-streaming
GEMV. cuBLAS runs them as split-K GEMMs (plus a reduce kernel for o_proj and down); on the H200 4B shape this
plain kernel (one program per ``BLOCK_N`` output rows, the whole K in ``BLOCK_K`` chunks, fp32 accumulation)
streams the weights faster: qkv 9.5 vs 11.4 us, o_proj 7.2 vs 10.2, down 13.8 vs 17.6 us. For gate_up a program
also computes the matching ``up`` rows and writes ``silu(gate) * up``: 25.6 us against 32.3 for cuBLAS and
FlashInfer's activation kernel (``benchmarks/results/h200_20261202c/row_gemv_20261202-055936.json``).

A decode step of 2 to ``FEW_ROWS`` requests is still weight-bound, but cuBLAS's kernels for a few rows stream the
weights slower still; ``few_rows_linear`` pads the rows to one 16-row tensor-core tile (``tl.dot``), one program
per ``BLOCK_N`` output columns over the whole K. On an H100 at 16 rows (4B shape, 36 weight copies in one graph):
qkv 13.4 vs 14.4 us, o_proj 10.1 vs 12.6, gate_up 36.2 vs 39.1 (without SiLU-and-mul), down 20.4 vs 22.9
(``benchmarks/probes/rows_gemm_tc.py``, ``results/h100_20261206f``); it fuses SiLU-and-mul the same way.

Numerics follow the unfused path: the products summed in fp32, the linear's output rounded once to the weight
dtype (as cuBLAS stores it), SiLU-and-mul in fp32 on the two rounded halves, rounded once more (as FlashInfer's
activation kernel stores it). The summation order differs from cuBLAS's, so results agree to rounding, not bits.

Whether a linear uses these kernels is measured per GPU and shape at warm-up (``cuda_graphs.kernels
.choose_row_linears``, once per kernel); the model calls them through its kernels object only for inputs of one
row (``row_linear``) or of 2 to ``FEW_ROWS`` rows (``few_rows_linear``). This module needs triton;
``ops.FlashInferKernels`` imports it lazily, so ``import higgs_talker`` never imports triton. Under
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl


class RowConfig(NamedTuple):
    """A tile: output rows per program, K chunk, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# the tiles warm-up tries: the H200 probe's best for the 4B shape's o_proj and down, qkv, gate_up with SiLU-and-mul
# (``benchmarks/probes/row_gemv.py``, ``results/h200_20261202c/row_gemv_20261202-055936.json``)
CONFIGS = (RowConfig(2, 1024, 4, 2), RowConfig(2, 512, 2, 2), RowConfig(1, 512, 2, 3))

# the most rows ``few_rows_linear`` takes: one tensor-core tile of rows (a decode bucket of 16 at most)
FEW_ROWS = 16
# its tiles (output columns a program, K chunk, warps, stages): the H100 probe's best at 16 rows for qkv, o_proj
# and down, gate_up (``benchmarks/probes/rows_gemm_tc.py``, ``results/h100_20261206f``). The first fits every
# linear (``row_gemv="on"`` takes the first correct one); gate_up's SiLU-and-mul holds two weight tiles, and with
# the second (4 stages of 512-wide chunks) that exceeds an H100's shared memory: warm-up then skips it there.
FEW_ROW_CONFIGS = (RowConfig(64, 256, 4, 3), RowConfig(32, 512, 4, 4), RowConfig(32, 128, 4, 3))


@triton.jit
def _rounded_silu_mul(gate, up, DTYPE: tl.constexpr):
    # both halves rounded as the GEMM stores them (to DTYPE), then SiLU-and-mul in fp32
    gate = gate.to(DTYPE).to(tl.float32)
    up = up.to(DTYPE).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _row_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # program p: output rows [p * BLOCK_N, (p + 1) * BLOCK_N); with SILU_MUL also the up rows N + those
    if PDL:  # launched early (``pdl``): wait for the kernel before this one to complete
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + cols, mask=col_ok, other=0).to(tl.float32)[None, :]
        acc += tl.load(w_rows + cols[None, :], mask=mask, other=0).to(tl.float32) * x
        if SILU_MUL:
            acc_up += tl.load(w_rows + N * K + cols[None, :], mask=mask, other=0).to(tl.float32) * x
    if PDL:  # the weights are read: the next kernel may start launching
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    if SILU_MUL:
        y = _rounded_silu_mul(y, tl.sum(acc_up, axis=1), y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def row_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, config: RowConfig = CONFIGS[0], silu_mul: bool = False
) -> Tensor:
    """x [1, K] -> [1, N] = ``x @ weight.T + bias`` for weight [N, K]; with ``silu_mul`` weight is gate | up
    [2 I, K] and the result is ``silu(gate) * up`` [1, I]. x and weight contiguous, one dtype."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"row_linear takes one row [1, K], got x of shape {tuple(x.shape)}")
    n = _check(x, weight, bias, silu_mul, "row_linear")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config
    early = pdl.enabled(x.device)
    _row_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else y, y, n, x.shape[1],
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BLOCK_N=block_n, BLOCK_K=block_k, PDL=early,
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if early else {}),
    )  # fmt: skip
    return y


@triton.jit
def _few_rows_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    IEEE: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    # program p: output columns [p * BLOCK_N, (p + 1) * BLOCK_N) of all M rows (padded to one tile of ROWS, 16);
    # with SILU_MUL also the up columns N + those
    if PDL:  # launched early (``pdl``): wait for the kernel before this one to complete
        tl.extra.cuda.gdc_wait()
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_cols = w_ptr + cols[None, :].to(tl.int64) * K
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        # fp32 inputs (the interpreter's tests) multiply exactly; bf16 / fp16 ones on tensor cores
        acc = tl.dot(x, tl.load(w_cols + ks[:, None], mask=w_mask, other=0), acc,
                     input_precision="ieee" if IEEE else "tf32")  # fmt: skip
        if SILU_MUL:
            acc_up = tl.dot(x, tl.load(w_cols + N * K + ks[:, None], mask=w_mask, other=0), acc_up,
                            input_precision="ieee" if IEEE else "tf32")  # fmt: skip
    if PDL:  # the weights are read: the next kernel may start launching
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0).to(tl.float32)[None, :]
    if SILU_MUL:
        acc = _rounded_silu_mul(acc, acc_up, y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def few_rows_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, config: RowConfig = FEW_ROW_CONFIGS[0],
    silu_mul: bool = False,
) -> Tensor:  # fmt: skip
    """x [M, K] (1 <= M <= ``FEW_ROWS``) -> [M, N] = ``x @ weight.T + bias`` for weight [N, K]; with ``silu_mul``
    weight is gate | up [2 I, K] and the result is ``silu(gate) * up`` [M, I]. x and weight contiguous, one
    dtype; ``config.block_n`` at least 16 (a tensor-core tile's side)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= FEW_ROWS:
        raise ValueError(f"few_rows_linear takes 1 to {FEW_ROWS} rows [M, K], got x of shape {tuple(x.shape)}")
    n = _check(x, weight, bias, silu_mul, "few_rows_linear")
    block_n, block_k, warps, stages = config
    if block_n < 16 or block_k < 16:
        raise ValueError(f"few_rows_linear's tile needs block_n and block_k >= 16, got {tuple(config)}")
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    early = pdl.enabled(x.device)
    _few_rows_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else y, y, x.shape[0], n, x.shape[1],
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BLOCK_N=block_n, BLOCK_K=block_k, PDL=early,
        IEEE=x.dtype == torch.float32, ROWS=FEW_ROWS, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if early else {}),
    )  # fmt: skip
    return y


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, silu_mul: bool, name: str) -> int:
    """Raise ValueError for what ``name`` cannot take; returns the output's columns."""
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not take x of shape {tuple(x.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")  # fmt: skip
    if silu_mul and (weight.shape[0] % 2 or bias is not None):
        raise ValueError(f"silu_mul needs an even number of weight rows and no bias, got {weight.shape[0]} rows"
                         f"{' and a bias' if bias is not None else ''}")  # fmt: skip
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"{name} needs contiguous x and weight")
    return weight.shape[0] // 2 if silu_mul else weight.shape[0]
