"""Paged KV cache: a pure-Python block allocator and the per-layer cache tensors."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import TextConfig


class BlockAllocator:
    """Hands out fixed-size KV blocks by id; every block is either free or owned by exactly one request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks} / {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache exhausted: {n} blocks requested, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._owned.update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._owned:
                raise RuntimeError(f"block {b} freed but not allocated")
            self._owned.remove(b)
            self._free.append(b)


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of token positions [start, end) of one request."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def allocate_kv_caches(
    cfg: TextConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[Tensor]:
    """One ``[num_blocks, 2, block_size, kv_heads, head_dim]`` tensor per layer (NHD paged layout)."""
    shape = (num_blocks, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]


def kv_bytes_per_token(cfg: TextConfig, dtype: torch.dtype) -> int:
    return (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()
    )
