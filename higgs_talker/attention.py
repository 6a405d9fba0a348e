"""Attention over a paged KV cache: the backend protocol, the step's backend context, and the torch SDPA
reference backend.

The KV cache of one layer is ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (FlashInfer's NHD paged
layout; K at index 0, V at 1). A backend's life per step (the protocol, which SDPA and FlashInfer implement in
full):

    plan(batch)             host, eager steps: prefill or decode of exactly this ``StepBatch``
    plan_bucket(batch)      host, graph-bucket decode steps: ``batch``, already padded to its bucket, goes into
                            that bucket's fixed device buffers, which a captured graph reads at replay
    plan_prefill_bucket(batch)  the same for a prefill padded to a token bucket (``StepBatch.padded_prefill``);
                            only where ``supports_prefill_graphs`` (FlashInfer; SDPA's prefill loops over
                            requests on the host, so it cannot replay)
    forward(layer, q, k, v) device: writes the step's K/V into the cache, then attends (graph-safe after
                            ``plan_bucket``); q [N, Hq, D], k/v [N, Hk, D] -> [N, Hq * D]
    kv_destination(layer)   (flat cache [R, Hk, D], rows [2, N] int64) where this step's K and V go, for a
                            kernel that writes them itself; None where the backend writes them (SDPA)
    attend(layer, q)        device: ``forward`` without the writes, after such a kernel (where the above is
                            not None)
    decode_kernels          the decode kernels ``plan_bucket`` may use (``cuda_graphs.kernels`` measures them)
    set_bucket_kernel(size, kernel), fork(kv_caches)

The model's attention layers find the step's backend through ``use_backend`` (a context variable, so two
talkers in two threads never see each other's), as vLLM's layers find theirs in its forward context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from .batch import StepBatch


class AttentionBackend(Protocol):
    kv_caches: list[Tensor]
    num_heads: int
    scale: float
    max_model_len: int
    scratch_block: int  # the KV block no request owns; blocks [0, scratch_block) are the requests' pool
    decode_kernels: tuple[str, ...]
    supports_prefill_graphs: bool

    def plan(self, batch: StepBatch) -> None: ...

    def plan_bucket(self, batch: StepBatch) -> None: ...

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...

    def kv_destination(self, layer: int) -> tuple[Tensor, Tensor] | None: ...

    def attend_qkv(self, layer: int, qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                   cos_sin: Tensor) -> Tensor | None: ...  # fmt: skip

    def set_bucket_kernel(self, size: int, kernel: str) -> None: ...

    def fork(self, kv_caches: list[Tensor]) -> AttentionBackend: ...


_BACKEND: ContextVar[AttentionBackend] = ContextVar("higgs_talker_attention_backend")


@contextmanager
def use_backend(backend: AttentionBackend) -> Iterator[None]:
    """Make ``backend`` the one the model's attention layers call (for the duration of a forward)."""
    token = _BACKEND.set(backend)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def current_backend() -> AttentionBackend:
    try:
        return _BACKEND.get()
    except LookupError:
        raise RuntimeError("the model ran outside use_backend(...): no attention backend for this step") from None


def block_table_array(tables: list[list[int]], width: int, fill: int) -> np.ndarray:
    """[B, width] int32 block table (host) of each request's first ``width`` blocks; entries past a request's
    blocks hold ``fill`` (a real block id, never read for a context that ends before them)."""
    out = np.full((len(tables), width), fill, dtype=np.int32)
    for i, blocks in enumerate(tables):
        n = min(len(blocks), width)
        out[i, :n] = blocks[:n]
    return out


def write_kv(cache: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """Scatter new K/V rows [N, Hk, D] into a layer's paged cache at ``slot_mapping`` [N]."""
    block_size = cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    cache[blocks, 0, offsets] = k.to(cache.dtype)
    cache[blocks, 1, offsets] = v.to(cache.dtype)


def gather_kv(cache: Tensor, block_table: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """One request's context K, V as [length, Hk, D] from its block table row."""
    block_size = cache.shape[2]
    n_blocks = -(-length // block_size)
    kv = cache[block_table[:n_blocks].long()]  # [nb, 2, bs, Hk, D]
    k = kv[:, 0].reshape(-1, *cache.shape[3:])[:length]
    v = kv[:, 1].reshape(-1, *cache.shape[3:])[:length]
    return k, v


class _Decode:
    """Device inputs of a decode over padded block tables: what ``SdpaAttention._decode`` reads."""

    def __init__(self, slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor) -> None:
        self.slot_mapping = slot_mapping  # [B] int64
        self.block_tables = block_tables  # [B, W] int64
        self.seq_lens = seq_lens  # [B] int64


class SdpaAttention:
    """Reference backend: torch SDPA over K/V gathered from the paged cache (CPU and CUDA).

    Eager decode steps gather each request's blocks up to the batch's longest context; a bucket's fixed buffers
    span ``max_model_len`` (a graph cannot change shape), so graph-bucket steps gather every table entry.
    Masked positions contribute exactly zero either way.
    """

    decode_kernels = ("sdpa",)
    supports_prefill_graphs = False

    def __init__(
        self,
        kv_caches: list[Tensor],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_model_len: int,
        scratch_block: int = 0,
    ) -> None:
        self.kv_caches = kv_caches
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_model_len, self.scratch_block = max_model_len, scratch_block
        self.block_size = kv_caches[0].shape[2]
        self.max_blocks = -(-max_model_len // self.block_size)
        self.scale = head_dim**-0.5
        self.device = kv_caches[0].device
        self._buckets: dict[int, _Decode] = {}
        self._decode: _Decode | None = None
        self._prefill: tuple[Tensor, Tensor, list[int], list[int]] | None = None

    def fork(self, kv_caches: list[Tensor]) -> SdpaAttention:
        return SdpaAttention(kv_caches, self.num_heads, self.num_kv_heads, self.head_dim, self.max_model_len, 0)

    def set_bucket_kernel(self, size: int, kernel: str) -> None:
        if kernel not in self.decode_kernels:
            raise ValueError(f"SDPA has no decode kernel {kernel!r}; it has {', '.join(self.decode_kernels)}")

    def _tensor(self, values, dtype=torch.long) -> Tensor:
        return torch.as_tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def plan(self, batch: StepBatch) -> None:
        slots = self._tensor(batch.slot_mapping)
        if batch.is_decode:
            width = -(-max(batch.seq_lens) // self.block_size)
            tables = block_table_array(batch.block_tables, width, self.scratch_block)
            self._decode = _Decode(slots, self._tensor(tables), self._tensor(batch.seq_lens))
            self._prefill = None
        else:
            width = max(len(t) for t in batch.block_tables)
            tables = self._tensor(block_table_array(batch.block_tables, width, self.scratch_block))
            self._prefill = (slots, tables, list(batch.query_lens), list(batch.seq_lens))
            self._decode = None

    def plan_bucket(self, batch: StepBatch) -> None:
        size = batch.num_reqs
        buf = self._buckets.get(size)
        if buf is None:
            buf = self._buckets[size] = _Decode(
                torch.zeros(size, dtype=torch.long, device=self.device),
                torch.zeros(size, self.max_blocks, dtype=torch.long, device=self.device),
                torch.ones(size, dtype=torch.long, device=self.device),
            )
        tables = block_table_array(batch.block_tables, self.max_blocks, self.scratch_block)
        buf.slot_mapping.copy_(self._tensor(batch.slot_mapping))
        buf.block_tables.copy_(self._tensor(tables))
        buf.seq_lens.copy_(self._tensor(batch.seq_lens))
        self._decode, self._prefill = buf, None

    def kv_destination(self, layer: int) -> None:
        """None: SDPA writes K/V itself in ``forward`` (so the model runs QK-norm and RoPE separately)."""
        return None

    def attend_qkv(self, layer: int, qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                   cos_sin: Tensor) -> None:  # fmt: skip
        """None: no SDPA step takes qkv rows."""
        return None

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [N, Hq, D], k/v [N, Hk, D] -> attention output [N, Hq*D]."""
        cache = self.kv_caches[layer]
        if self._decode is not None:
            write_kv(cache, self._decode.slot_mapping, k, v)
            return self._decode_attention(cache, q, self._decode)
        assert self._prefill is not None, "plan() or plan_bucket() was not called for this step"
        slots, tables, query_lens, seq_lens = self._prefill
        write_kv(cache, slots, k, v)
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        start = 0
        for i, (q_len, ctx) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if q_len == 0:  # an empty padding request
                continue
            ck, cv = gather_kv(cache, tables[i], ctx)
            qi = q[start : start + q_len].transpose(0, 1)  # [Hq, q_len, D]
            ki, vi = ck.transpose(0, 1).to(q.dtype), cv.transpose(0, 1).to(q.dtype)
            if q_len == ctx:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale, enable_gqa=True)
            else:  # queries are the last q_len positions of the context
                qpos = torch.arange(ctx - q_len, ctx, device=q.device)
                mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start : start + q_len] = o.transpose(0, 1).reshape(q_len, -1)
            start += q_len
        return out

    def _decode_attention(self, cache: Tensor, q: Tensor, d: _Decode) -> Tensor:
        b, hk, hd = q.shape[0], cache.shape[3], cache.shape[4]
        kv = cache[d.block_tables]  # [B, W, 2, bs, Hk, D]
        k = kv[:, :, 0].reshape(b, -1, hk, hd).transpose(1, 2).to(q.dtype)  # [B, Hk, L, D]
        v = kv[:, :, 1].reshape(b, -1, hk, hd).transpose(1, 2).to(q.dtype)
        pos = torch.arange(k.shape[2], device=q.device)
        mask = (pos[None, :] < d.seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
        o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.reshape(b, -1)
