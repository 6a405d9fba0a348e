"""Paged KV cache: a pure-Python block allocator (with a prefix cache), the per-layer cache tensors, and their
memory budget."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .config import TextConfig

if TYPE_CHECKING:
    from .prompt import Prompt


class BlockAllocator:
    """Hands out fixed-size KV blocks by id, with reference counts and an optional prefix cache.

    Without the cache every block is free or held by exactly one request. With it (``register``), a block
    whose K/V are a known prompt prefix keeps its content when its last holder frees it: it stays findable by
    that prefix's hash (``lookup``) and other requests hold it too (``share``) until ``allocate`` needs it back;
    such blocks count as free and are reused least recently freed first.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks} / {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}  # held block -> number of holders
        self._by_hash: dict[bytes, int] = {}  # prefix hash -> the block holding that prefix's last block
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with no cached content (cached blocks nobody holds are evicted, oldest first)."""
        if n > self.num_free:
            raise RuntimeError(f"KV cache exhausted: {n} blocks requested, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Give up one hold of each block. A request's blocks go last first: of a cached prefix nobody holds,
        the tail is reused before the head, which more prompts share."""
        for b in reversed(blocks):
            refs = self._refs.get(b)
            if refs is None:
                raise RuntimeError(f"block {b} freed but not allocated")
            if refs > 1:
                self._refs[b] = refs - 1
                continue
            del self._refs[b]
            if b in self._hash_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` from the start (nothing is taken)."""
        found = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def share(self, blocks: list[int]) -> None:
        """Hold cached blocks (from ``lookup``) for one more request."""
        for b in blocks:
            if b not in self._hash_of:
                raise RuntimeError(f"block {b} holds no cached prefix")
            if b in self._refs:
                self._refs[b] += 1
            else:
                del self._evictable[b]
                self._refs[b] = 1

    def register(self, block: int, prefix_hash: bytes) -> None:
        """A held block now holds the K/V of the prefix ``prefix_hash`` names (a no-op if another already does)."""
        if block not in self._refs:
            raise RuntimeError(f"block {block} is registered but not allocated")
        if prefix_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[prefix_hash] = block
            self._hash_of[block] = prefix_hash

    @property
    def num_cached(self) -> int:
        """Blocks that hold a cached prefix (held or not)."""
        return len(self._hash_of)

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)


def prefix_hashes(prompt: Prompt, block_size: int) -> list[bytes]:
    """One hash per full block of a prompt, each naming everything up to that block's end: token ids, and the
    reference codes of the audio positions (whose embeddings replace the placeholder ids, so two voices with
    the same text never share a block)."""
    ids = prompt.input_ids.to(torch.int64)
    audio: dict[int, bytes] = {}
    if prompt.audio_codes is not None:
        codes = prompt.audio_codes.to(torch.int64)
        audio = {int(p): codes[i].numpy().tobytes() for i, p in enumerate(prompt.audio_positions.tolist())}
    hashes, parent = [], b""
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(ids[start : start + block_size].numpy().tobytes())
        for p in range(start, start + block_size):
            if p in audio:
                h.update(p.to_bytes(8, "little") + audio[p])
        parent = h.digest()
        hashes.append(parent)
    return hashes


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
