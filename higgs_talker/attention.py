"""Attention over a paged KV cache: step metadata and the torch SDPA reference backend.

The KV cache of one layer is a tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (FlashInfer's
NHD paged layout, K at index 0 and V at 1). A step's tokens are flat: ``query_start_loc`` splits them into
requests; ``slot_mapping`` says where each new token's K/V goes; ``block_tables`` lists each request's blocks.

Backends share one protocol: ``begin(meta)`` once per step on the host (FlashInfer plans there), then
``forward(layer, q, k, v)`` per layer (graph-safe for the CUDA backends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .cuda_graphs.buckets import pad_to


@dataclass
class AttnMetadata:
    """One step's attention inputs: device tensors plus host copies (read without a sync).

    The device tensors are ``None`` when the backend plans from the host lists alone (``plans_from_host``), as
    FlashInfer's decode does: a decode step then makes no metadata tensors at all.
    """

    slot_mapping: Tensor | None  # [N] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: Tensor | None  # [B+1] int32: token span of each request
    seq_lens: Tensor | None  # [B] int32: context length of each request after this step
    block_tables: Tensor | None  # [B, max_blocks] int32
    query_lens_host: list[int]
    seq_lens_host: list[int]
    slot_mapping_host: list[int] | None = None  # host copies for the FlashInfer planner
    blocks_host: list[list[int]] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_host)

    def padded(self, size: int, scratch_block: int, block_size: int) -> AttnMetadata:
        """Decode metadata padded to ``size`` requests of one token each; padding requests have context 1 and
        write their K/V into ``scratch_block``, which no request owns."""
        pad = size - self.num_reqs
        if pad < 0 or not self.is_decode_only:
            raise ValueError(f"can only pad a decode batch up, got {self.num_reqs} requests -> {size}")
        scratch_slot = scratch_block * block_size

        def cat(t: Tensor | None, value: int, shape: tuple[int, ...]) -> Tensor | None:
            if t is None:
                return None
            return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)])

        qsl, slots, blocks = self.query_start_loc, self.slot_mapping_host, self.blocks_host
        return AttnMetadata(
            slot_mapping=cat(self.slot_mapping, scratch_slot, (pad,)),
            query_start_loc=None if qsl is None else torch.arange(size + 1, dtype=qsl.dtype, device=qsl.device),
            seq_lens=cat(self.seq_lens, 1, (pad,)),
            block_tables=None
            if self.block_tables is None
            else cat(self.block_tables, scratch_block, (pad, self.block_tables.shape[1])),
            query_lens_host=[1] * size,
            seq_lens_host=pad_to(self.seq_lens_host, size, 1),
            slot_mapping_host=None if slots is None else pad_to(slots, size, scratch_slot),
            blocks_host=None if blocks is None else pad_to(blocks, size, [scratch_block]),
        )


class AttentionBackend(Protocol):
    def begin(self, meta: AttnMetadata) -> None: ...

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


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


class SdpaAttention:
    """Reference backend: torch SDPA over K/V gathered from the paged cache (CPU and CUDA)."""

    plans_from_host = False  # reads the metadata's device tensors

    def __init__(self, kv_caches: list[Tensor], num_heads: int, head_dim: int) -> None:
        self.kv_caches = kv_caches
        self.num_heads = num_heads
        self.scale = head_dim**-0.5
        self.meta: AttnMetadata | None = None
        self._decode_mask: Tensor | None = None
        self._decode_index: Tensor | None = None

    def begin(self, meta: AttnMetadata) -> None:
        self.meta = meta
        self._decode_mask = self._decode_index = None
        if meta.is_decode_only:
            # Decode: every request attends to its whole context; pad to the longest and mask the rest.
            cache = self.kv_caches[0]
            block_size = cache.shape[2]
            max_len = max(meta.seq_lens_host)
            n_blocks = -(-max_len // block_size)
            pos = torch.arange(n_blocks * block_size, device=cache.device)
            self._decode_mask = pos[None, :] < meta.seq_lens[:, None].to(pos.device)  # [B, L]
            self._decode_index = meta.block_tables[:, :n_blocks].long()  # [B, nb]

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [N, Hq, D], k/v [N, Hk, D] -> attention output [N, Hq*D]."""
        meta = self.meta
        assert meta is not None, "begin() was not called for this step"
        cache = self.kv_caches[layer]
        write_kv(cache, meta.slot_mapping, k, v)
        if self._decode_mask is not None:
            return self._decode(cache, q)
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        start = 0
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
            ck, cv = gather_kv(cache, meta.block_tables[i], ctx)
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

    def _decode(self, cache: Tensor, q: Tensor) -> Tensor:
        b, hk, d = q.shape[0], cache.shape[3], cache.shape[4]
        kv = cache[self._decode_index]  # [B, nb, 2, bs, Hk, D]
        k = kv[:, :, 0].reshape(b, -1, hk, d).transpose(1, 2).to(q.dtype)  # [B, Hk, L, D]
        v = kv[:, :, 1].reshape(b, -1, hk, d).transpose(1, 2).to(q.dtype)
        mask = self._decode_mask[:, None, None, :]  # [B, 1, 1, L]
        o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.reshape(b, -1)
