"""One Triton kernel for the attention input of a decoder layer: QK-norm + neox RoPE + the K/V cache writes.

Unfused, a layer runs five small kernels between its qkv GEMM and attention (RMSNorm of q, of k, RoPE, two
index writes into the paged cache); at batch 1 they cost about as much as the attention itself. Here one launch
over (token, head) reads the GEMM output once, writes the rotated Q to a new tensor and K (normed, rotated) and V
(as is) straight into the cache rows the backend planned (``FlashInferAttention.kv_destination``).

Numerics follow the unfused path step by step: the RMSNorm statistics and products in fp32, the normed head
rounded once to the input dtype (as the norm kernel stores it), RoPE in fp32 on that value, rounded once more.

This module needs triton; ``ops.FlashInferKernels`` imports it only when asked to fuse, so ``import
higgs_talker`` never imports triton. Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (tests).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head size: a power of two from 16 to 256 (Triton ranges are powers of 2)."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


# positions and kv_rows are views whose alignment and row stride change with the batch (bucket slices of fixed
# buffers): not specialising on them keeps one compiled variant per dtype and shape instead of one per batch
@triton.jit(do_not_specialize=["pos_ptr", "rows_stride"])
def _qk_norm_rope_store_kernel(
    qkv_ptr,
    qkv_stride,
    pos_ptr,
    q_weight_ptr,
    k_weight_ptr,
    eps,
    cos_sin_ptr,
    cache_ptr,
    rows_ptr,
    rows_stride,
    q_ptr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
):
    # one program per (token, head of the qkv row): heads [0, HQ) are Q, [HQ, HQ + HK) K, the rest V
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    lo = tl.arange(0, D // 2)  # neox RoPE rotates the first half of a head against the second
    hi = lo + D // 2
    src = qkv_ptr + tok * qkv_stride + head * D
    x1 = tl.load(src + lo)
    x2 = tl.load(src + hi)
    if head >= HQ + HK:  # V: into its cache row unchanged
        dst = cache_ptr + (tl.load(rows_ptr + rows_stride + tok) * HK + (head - HQ - HK)) * D
        tl.store(dst + lo, x1.to(cache_ptr.dtype.element_ty))
        tl.store(dst + hi, x2.to(cache_ptr.dtype.element_ty))
    else:
        w_ptr = q_weight_ptr if head < HQ else k_weight_ptr
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        r = tl.rsqrt((tl.sum(a1 * a1, axis=0) + tl.sum(a2 * a2, axis=0)) / D + eps)
        # the normed head, rounded to the input dtype as the separate norm kernel would store it
        n1 = (a1 * r * tl.load(w_ptr + lo).to(tl.float32)).to(x1.dtype).to(tl.float32)
        n2 = (a2 * r * tl.load(w_ptr + hi).to(tl.float32)).to(x1.dtype).to(tl.float32)
        row = cos_sin_ptr + tl.load(pos_ptr + tok).to(tl.int64) * D  # [cos | sin] of this position
        cos = tl.load(row + lo)
        sin = tl.load(row + hi)
        y1 = n1 * cos - n2 * sin
        y2 = n2 * cos + n1 * sin
        if head < HQ:
            dst = q_ptr + (tok * HQ + head) * D
            tl.store(dst + lo, y1.to(q_ptr.dtype.element_ty))
            tl.store(dst + hi, y2.to(q_ptr.dtype.element_ty))
        else:
            dst = cache_ptr + (tl.load(rows_ptr + tok) * HK + (head - HQ)) * D
            tl.store(dst + lo, y1.to(cache_ptr.dtype.element_ty))
            tl.store(dst + hi, y2.to(cache_ptr.dtype.element_ty))


def qk_norm_rope_store(
    qkv: Tensor,
    positions: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos_sin: Tensor,
    flat_cache: Tensor,
    kv_rows: Tensor,
) -> Tensor:
    """qkv [N, (Hq + 2 Hk) D] (rows may be strided), positions [N] int, q/k_weight [D], cos_sin [P, D] fp32,
    flat_cache [R, Hk, D], kv_rows [2, N] int64 -> q [N, Hq, D] in qkv's dtype, normed and rotated.

    K (normed, rotated) goes to ``flat_cache[kv_rows[0]]``, V to ``flat_cache[kv_rows[1]]``; no other row is
    touched. One launch, no host sync (graph-capturable); positions and rows are not range-checked (device data).
    """
    check_inputs(qkv, positions, q_weight, k_weight, cos_sin, flat_cache, kv_rows)
    n, width = qkv.shape
    _, hk, d = flat_cache.shape
    hq = width // d - 2 * hk
    q = torch.empty(n, hq, d, dtype=qkv.dtype, device=qkv.device)
    if n:  # FMA contraction stated, not left to Triton's default (which changes in 3.10): nvcc contracts too
        _qk_norm_rope_store_kernel[(n, hq + 2 * hk)](
            qkv, qkv.stride(0), positions, q_weight, k_weight, eps, cos_sin, flat_cache, kv_rows, kv_rows.stride(0), q,
            HQ=hq, HK=hk, D=d, num_warps=max(1, d // 128), enable_fp_fusion=True,
        )  # fmt: skip
    return q


def check_inputs(
    qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, cos_sin: Tensor, flat_cache: Tensor,
    kv_rows: Tensor,
) -> None:  # fmt: skip
    """``qk_norm_rope_store``'s arguments as its kernel takes them (a ValueError naming the first that is not);
    ``triton_attention.paged_decode_qkv`` takes the same."""
    if flat_cache.dim() != 3 or not flat_cache.is_contiguous():
        raise ValueError(f"flat_cache must be a contiguous [rows, Hk, D] tensor, got shape {tuple(flat_cache.shape)}")
    _, hk, d = flat_cache.shape
    if not supports(d):
        raise ValueError(f"head_dim {d} is not supported by the fused kernel (a power of two from 16 to 256)")
    if qkv.dim() != 2 or qkv.stride(-1) != 1 or qkv.shape[1] % d or qkv.shape[1] // d <= 2 * hk:
        raise ValueError(
            f"qkv must be [N, (Hq + 2 * {hk}) * {d}] with unit stride along a row, got shape {tuple(qkv.shape)} "
            f"and strides {qkv.stride()}"
        )
    n = qkv.shape[0]
    if positions.shape != (n,) or positions.dtype.is_floating_point or (n > 1 and positions.stride(0) != 1):
        raise ValueError(f"positions must be a contiguous [{n}] integer tensor, got {positions.dtype} "
                         f"{tuple(positions.shape)}")  # fmt: skip
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (d,) or not w.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{d}] tensor, got shape {tuple(w.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != d or cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
        raise ValueError(f"cos_sin must be a contiguous [max_positions, {d}] float32 table, got {cos_sin.dtype} "
                         f"{tuple(cos_sin.shape)}")  # fmt: skip
    if kv_rows.shape != (2, n) or kv_rows.dtype != torch.int64 or (n > 1 and kv_rows.stride(1) != 1):
        raise ValueError(f"kv_rows must be [2, {n}] int64 with unit stride along a row, got {kv_rows.dtype} "
                         f"{tuple(kv_rows.shape)}")  # fmt: skip
    devices = {t.device for t in (qkv, positions, q_weight, k_weight, cos_sin, flat_cache, kv_rows)}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
