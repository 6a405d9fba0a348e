"""Decode attention over the paged KV cache in one Triton launch: split over the context, merged in the same kernel.

FlashInfer's decode kernels split a short context into chunks and merge the partial results in a second kernel;
at one request and a few hundred tokens the pair costs 11.7 us a layer on the H200 for 0.4 us worth of KV
(docs/performance.md). Here a program per (request, KV head, split) attends its group of query heads (GQA) over
its chunk of the context with tensor-core dots (the group padded to 16 rows), writes its partial result (running
max, sum and unnormalised output, fp32) to a scratch buffer, and counts itself done on a per-(request, KV head)
counter; the program that finishes last merges the splits, writes the output and resets the counter for the next
launch. So a step has one attention launch a layer and no host-side plan: the block tables and lengths are device
tensors, and the split count is fixed per batch size, so one CUDA graph serves every context length. A short context
uses fewer splits than the launch has (chunks are whole tiles); the programs past its last chunk return at once and
are not counted.

``paged_decode_qkv`` also takes over the kernel before it (``triton_ops``): each program norms and rotates its
group's query heads from the qkv row of the request's new token, and the split holding that token writes its K
(normed, rotated) and V into the cache before reading, one launch a layer fewer. On an H100 (4B shape) this kernel was
faster than FlashInfer's ``native_tc`` in whole decode steps at batches 1-64 and contexts 512 and 2,048
(``results/h100_20261206e``).

Numerics: scores and softmax in fp32 (exp2 with the scale folded in), probabilities rounded to the cache dtype for
the second dot as FlashAttention-style kernels do, the merge in fp32, the output rounded once.

This module needs triton; ``flashinfer_attention`` imports it only for the ``triton`` decode kernel, so ``import
higgs_talker`` never imports triton. Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (tests); there its bf16
dots take fp32 copies of the same values (the interpreter multiplies bf16 as raw bits), the rest is as on a GPU.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl, triton_ops

TILE = 32  # context tokens per inner iteration (a multiple of 16: the dots' smallest side)
MAX_SPLITS = 32
# programs a launch aims at per multiprocessor: two fit at once (176 registers a thread, 128 threads), and a second
# round hides the first's tail. One program per SM left each of 16 requests' programs a 2,048-token context to
# walk alone: 7.14 ms a step against FlashInfer's 5.83 (H100, results/h100_20261206e)
PROGRAMS_PER_SM = 4


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this shape: head_dim a power of two from 16 to 256, query heads a multiple of the
    KV heads with a group of at most 16."""
    group = num_heads // max(num_kv_heads, 1)
    return (16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and num_kv_heads > 0
            and num_heads % num_kv_heads == 0 and group <= 16)  # fmt: skip


def splits_for(batch: int, num_kv_heads: int, programs: int) -> int:
    """The split count for ``batch`` requests on a device of ``programs`` multiprocessors: a power of two (at most
    ``MAX_SPLITS``) giving about ``PROGRAMS_PER_SM`` programs a multiprocessor, one where the batch fills that
    alone."""
    want = max(1, PROGRAMS_PER_SM * programs // max(1, batch * num_kv_heads))
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1))


class DecodeScratch:
    """The partial results and counters one launch uses, sized for ``max_batch`` requests at the split counts
    ``splits_for`` gives (fixed buffers: a captured graph keeps reading them). The counters must be zero between
    launches; each launch leaves them so."""

    def __init__(self, max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int, programs: int,
                 device: torch.device) -> None:  # fmt: skip
        self.programs = programs
        self.group = num_heads // num_kv_heads
        most = max(b * num_kv_heads * splits_for(b, num_kv_heads, programs) for b in range(1, max_batch + 1))
        self.partial = torch.empty(most * self.group, head_dim, dtype=torch.float32, device=device)
        self.max_sum = torch.empty(most * self.group, 2, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)
        self.max_batch = max_batch


@triton.jit
def _normed_rotated(heads, ok, w_ptr, cs_ptr, eps, D: tl.constexpr):
    # heads [R] pointers to R heads of D values (``ok``: which exist) -> [R, D] in their dtype: RMSNorm with w_ptr's
    # weight (rounded to the dtype, as the norm kernel stores it), then neox RoPE with the [cos | sin] row at cs_ptr
    # in fp32, rounded once more: ``triton_ops``' numerics
    dims = tl.arange(0, D)
    half = D // 2
    partner = (dims + half) % D  # the other half of each rotated pair
    x = tl.load(heads[:, None] + dims[None, :], mask=ok[:, None], other=0.0)
    a = x.to(tl.float32)
    b = tl.load(heads[:, None] + partner[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(a * a, axis=1) / D + eps)[:, None]
    n = (a * r * tl.load(w_ptr + dims).to(tl.float32)[None, :]).to(x.dtype).to(tl.float32)
    m = (b * r * tl.load(w_ptr + partner).to(tl.float32)[None, :]).to(x.dtype).to(tl.float32)
    cos = tl.load(cs_ptr + dims % half)[None, :]
    sin = tl.load(cs_ptr + half + dims % half)[None, :]
    return tl.where(dims[None, :] < half, n * cos - m * sin, n * cos + m * sin).to(x.dtype)


@triton.jit(do_not_specialize=["table_stride", "qkv_stride", "rows_stride"])
def _paged_decode_kernel(
    q_ptr,
    qkv_ptr,
    qkv_stride,
    pos_ptr,
    q_weight_ptr,
    k_weight_ptr,
    eps,
    cos_sin_ptr,
    kv_rows_ptr,
    rows_stride,
    cache_ptr,
    tables_ptr,
    table_stride,
    lens_ptr,
    out_ptr,
    partial_ptr,
    max_sum_ptr,
    counters_ptr,
    scale_log2,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    S: tl.constexpr,
    TILE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    FUSED: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched early (``pdl``): wait for the kernel before this one to complete
        tl.extra.cuda.gdc_wait()
    # FUSED: the query is the qkv row of the request's one new token (QK-norm and RoPE here), and the split that
    # holds that token writes its K (normed, rotated) and V into the cache rows ``kv_rows`` before reading them
    req = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, GP)  # the group's query heads, padded to a dot's 16 rows
    dims = tl.arange(0, D)
    toks = tl.arange(0, TILE)
    row_ok = rows < G
    heads = (req * HQ + hk * G + rows).to(tl.int64)
    if FUSED:
        token = qkv_ptr + req.to(tl.int64) * qkv_stride
        cs = cos_sin_ptr + tl.load(pos_ptr + req).to(tl.int64) * D  # [cos | sin] of the token's position
        q = _normed_rotated(token + (hk * G + rows) * D, row_ok, q_weight_ptr, cs, eps, D)
    else:
        q = tl.load(q_ptr + heads[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    n = tl.load(lens_ptr + req)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(n, S), TILE) * TILE, TILE)
    used = tl.maximum(tl.cdiv(n, chunk), 1)  # the splits this context fills (one for an empty padding row)
    if split >= used:
        return
    if FUSED:  # noqa: SIM102 - a compile-time branch around a run-time one
        if split == used - 1:  # this split reads the new token: its K and V go into the cache first
            first = rows == 0
            k = _normed_rotated(token + (HQ + hk) * D + rows * 0, first, k_weight_ptr, cs, eps, D)
            k_row = tl.load(kv_rows_ptr + req).to(tl.int64)
            tl.store(cache_ptr + (k_row * HK + hk) * D + rows[:, None] * 0 + dims[None, :],
                     k.to(cache_ptr.dtype.element_ty), mask=first[:, None])  # fmt: skip
            v_row = tl.load(kv_rows_ptr + rows_stride + req).to(tl.int64)
            v = tl.load(token + (HQ + HK + hk) * D + dims)
            tl.store(cache_ptr + (v_row * HK + hk) * D + dims, v.to(cache_ptr.dtype.element_ty))
            tl.debug_barrier()  # the writes before this program's threads read those rows below
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    table = tables_ptr + req.to(tl.int64) * table_stride
    for start in range(lo, hi, TILE):
        t = start + toks
        t_ok = t < hi
        block = tl.load(table + t // BS, mask=t_ok, other=0).to(tl.int64)
        k_row = ((block * 2 * BS + t % BS) * HK + hk) * D  # cache [blocks, 2, BS, HK, D]: K, then V BS rows on
        k = tl.load(cache_ptr + k_row[:, None] + dims[None, :], mask=t_ok[:, None], other=0.0)
        v = tl.load(cache_ptr + (k_row + BS * HK * D)[:, None] + dims[None, :], mask=t_ok[:, None], other=0.0)
        p_dtype = v.dtype
        if UPCAST:  # the interpreter multiplies bf16 as its uint16 bits: exact fp32 products of the same values
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if PDL:  # the context is read: the next kernel may start launching
        tl.extra.cuda.gdc_launch_dependents()
    if S == 1:  # the whole context in this program: its output, no partial and no count
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # 0: no context (a padding row)
        tl.store(out_ptr + heads[:, None] * D + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        return
    # this split's partial result (an empty split: max -inf, sum 0), then count it done
    pair = (req * HK + hk).to(tl.int64)
    slot = (pair * S + split) * G + rows
    tl.store(partial_ptr + slot[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])
    tl.store(max_sum_ptr + slot * 2, m, mask=row_ok)
    tl.store(max_sum_ptr + slot * 2 + 1, total, mask=row_ok)
    tl.debug_barrier()  # every thread's stores issued before the (release) count
    done = tl.atomic_add(counters_ptr + pair, 1, sem="acq_rel")
    if done == used - 1:  # the last split of this (request, KV head): merge all of them
        first = pair * S * G
        best = tl.full([GP], float("-inf"), tl.float32)
        for i in tl.static_range(S):  # unrolled: the loads of every split issue together
            at = first + i * G + rows
            ok = row_ok & (tl.full([GP], i, tl.int32) < used)  # a split this context did not use: nothing
            best = tl.maximum(best, tl.load(max_sum_ptr + at * 2, mask=ok, other=float("-inf"), cache_modifier=".cg"))
        out = tl.zeros([GP, D], tl.float32)
        norm = tl.zeros([GP], tl.float32)
        for i in tl.static_range(S):  # unrolled: the loads of every split issue together
            at = first + i * G + rows
            ok = row_ok & (tl.full([GP], i, tl.int32) < used)  # a split this context did not use: nothing
            mi = tl.load(max_sum_ptr + at * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
            li = tl.load(max_sum_ptr + at * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            w = tl.where(mi == float("-inf"), 0.0, tl.exp2(mi - best))
            part = tl.load(partial_ptr + at[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0,
                           cache_modifier=".cg")  # fmt: skip
            out += w[:, None] * part
            norm += w * li
        out = out / tl.where(norm > 0, norm, 1.0)[:, None]  # 0: no context (a padding row)
        tl.store(out_ptr + heads[:, None] * D + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.atomic_xchg(counters_ptr + pair, 0)  # ready for the next launch


def paged_decode(q: Tensor, cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float,
                 scratch: DecodeScratch) -> Tensor:  # fmt: skip
    """q [B, Hq, D], cache [blocks, 2, block_size, Hk, D], block_tables [B, max_blocks] int32, seq_lens [B] int32
    (each >= 1, the new token's K/V already in the cache) -> [B, Hq, D] in q's dtype.

    One launch, no host sync (graph-capturable); tables and lengths are device data and not range-checked."""
    b, hq, d = q.shape
    _check(cache, block_tables, seq_lens, scratch, b, hq, d)
    return _launch(cache, block_tables, seq_lens, scale, scratch, q.contiguous(), hq, None)


def paged_decode_qkv(qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos_sin: Tensor,
                     kv_rows: Tensor, cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float,
                     scratch: DecodeScratch) -> Tensor:  # fmt: skip
    """``triton_ops.qk_norm_rope_store`` and ``paged_decode`` in one launch, for one new token a request: qkv
    [B, (Hq + 2 Hk) D] (rows may be strided), positions [B], q/k_weight [D], cos_sin [P, D] fp32, kv_rows [2, B]
    int64 (the token's K and V rows in the cache viewed as [rows, Hk, D]) -> [B, Hq, D] in qkv's dtype; the
    token's K (normed, rotated) and V are in the cache afterwards, as the separate kernel leaves them."""
    hk, d = cache.shape[3:] if cache.dim() == 5 else (1, 1)
    if cache.dim() == 5 and cache.is_contiguous():  # else _check names the cache
        triton_ops.check_inputs(qkv, positions, q_weight, k_weight, cos_sin, cache.view(-1, hk, d), kv_rows)
    hq = qkv.shape[1] // d - 2 * hk
    _check(cache, block_tables, seq_lens, scratch, qkv.shape[0], hq, d)
    fused = (qkv, qkv.stride(0), positions, q_weight, k_weight, eps, cos_sin, kv_rows, kv_rows.stride(0))
    return _launch(cache, block_tables, seq_lens, scale, scratch, None, hq, fused)


def _check(cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scratch: DecodeScratch, b: int, hq: int,
           d: int) -> None:  # fmt: skip
    if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[4] != d or not cache.is_contiguous():
        raise ValueError(
            f"cache must be a contiguous [blocks, 2, block_size, Hk, {d}] tensor, got {tuple(cache.shape)}"
        )
    hk = cache.shape[3]
    if not supports(hq, hk, d):
        raise ValueError(f"the Triton decode kernel does not take {hq} query heads over {hk} KV heads of {d}")
    if b > scratch.max_batch or hq // hk != scratch.group:
        raise ValueError(
            f"scratch sized for {scratch.max_batch} requests of group {scratch.group}, got {b} of {hq // hk}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{b}, max_blocks] with unit stride along a row, got "
                         f"{tuple(block_tables.shape)}")  # fmt: skip
    if seq_lens.shape != (b,) or (b > 1 and seq_lens.stride(0) != 1):
        raise ValueError(f"seq_lens must be a contiguous [{b}] tensor, got {tuple(seq_lens.shape)}")


def _launch(cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float, scratch: DecodeScratch,
            q: Tensor | None, hq: int, fused: tuple | None) -> Tensor:  # fmt: skip
    _, _, bs, hk, d = cache.shape
    b = block_tables.shape[0]
    dtype = q.dtype if q is not None else fused[0].dtype
    out = torch.empty(b, hq, d, dtype=dtype, device=cache.device)
    splits = splits_for(b, hk, scratch.programs)
    group = hq // hk
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16
    early = pdl.enabled(cache.device)
    if fused is None:  # the fused arguments' places: unused
        fused = (out, 0, seq_lens, out, out, 0.0, out, seq_lens, 0)
    if b:
        _paged_decode_kernel[(b, hk, splits)](
            out if q is None else q, *fused, cache, block_tables, block_tables.stride(0), seq_lens, out,
            scratch.partial, scratch.max_sum, scratch.counters, scale * math.log2(math.e),
            HQ=hq, HK=hk, D=d, BS=bs, G=group, GP=max(16, triton.next_power_of_2(group)), S=splits, TILE=TILE,
            PRECISION="ieee" if dtype == torch.float32 or interpreted else "tf32", UPCAST=interpreted,
            FUSED=q is None, PDL=early, num_warps=4, **({"launch_pdl": True} if early else {}),
        )  # fmt: skip
    return out
