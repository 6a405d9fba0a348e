"""Paged KV cache: a pure-Python block allocator, the per-layer cache tensors, and their memory budget."""

from __future__ import annotations

import os

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


def kv_slot(block_table: list[int], position: int, block_size: int) -> int:
    """The cache slot (``block * block_size + offset``) of one token position of a request."""
    return block_table[position // block_size] * block_size + position % block_size


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of token positions [start, end) of one request."""
    return [kv_slot(block_table, p, block_size) for p in range(start, end)]


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


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` in bytes: CUDA's free memory, or the host's available RAM (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not every platform reports available pages
        return None


def budget_num_blocks(
    cfg: TextConfig, dtype: torch.dtype, device: torch.device, block_size: int, want: int, fraction: float
) -> int:
    """KV blocks to allocate: ``want``, or fewer when ``fraction`` of the free memory holds fewer.

    Raises ``ValueError`` when not even one ``block_size``-token block fits.
    """
    free = free_memory_bytes(device)
    if free is None:
        return want
    per_block = kv_bytes_per_token(cfg, dtype) * block_size
    fits = int(free * fraction) // per_block
    if fits < 1:
        raise ValueError(
            f"not one KV block of {block_size} tokens ({per_block / 2**20:.1f} MiB) fits in {fraction:.0%} of the "
            f"free {device.type} memory ({free / 2**30:.2f} GiB)"
        )
    return min(want, fits)
