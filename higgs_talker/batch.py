"""One step's work: ``StepBatch`` (host lists, built by the scheduler) and ``DeviceBatch`` (what the model
runner and captured graphs read).

A step is a prefill (each request contributes a span of tokens: its prompt, or on resume its prompt plus every
fed-back row) or a decode (one token per request, embedded from the request's last frame). Shapes: B requests,
N tokens (N = B for decode), C codebooks. Vocabulary as in vLLM and FlashInfer: ``slot_mapping`` is the KV
cache slot (``block * block_size + offset``) of each token, ``block_tables`` each request's KV blocks,
``seq_lens`` each request's context after the step. ``slots`` are decode-state slots (``heads.slots``).

The padding rules, for graph buckets (the scratch decode-state slot and the scratch KV block belong to no
request):

- ``StepBatch.padded``: a decode batch grows to a batch bucket with requests of one token at position 0 in the
  scratch slot, writing their K/V into the scratch block; their context is that one token.
- ``StepBatch.padded_prefill``: a prefill batch grows to a token bucket and a fixed request count. Empty
  requests (no tokens, no context) follow the real ones, then one padding request that holds the padding
  tokens: text id 0 at position 0, its context that many positions of the scratch block (which only decode
  padding writes), its K/V written into a second block no request owns and nothing reads (the *dump* block:
  the padding tokens' rows may differ, and writing where they read would race). Every padding request is in
  the scratch slot; nothing reads what padding computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .heads.slots import SlotInit


@dataclass(frozen=True)
class StepBatch:
    slots: list[int]  # [B] decode-state slot of each request
    positions: list[int]  # [N] position of each token
    slot_mapping: list[int]  # [N] KV cache slot of each token
    query_lens: list[int]  # [B] tokens of each request in this step
    seq_lens: list[int]  # [B] context length of each request after this step
    block_tables: list[list[int]]  # [B] KV blocks of each request (at least those its context uses)
    token_ids: list[int] | None = None  # prefill: [N] text ids (decode: None, every token is audio)
    audio_index: list[int] = field(default_factory=list)  # prefill: [M] tokens embedded from codes instead
    audio_codes: Tensor | None = None  # prefill: [M, C] int64 CPU (reference rows, rows fed back on resume)
    new_slots: tuple[SlotInit, ...] = ()  # streams that start in this step (reset before it runs)
    draw: bool = True  # host-known: some request samples (temperature > 0); False: all greedy
    filter: bool = True  # host-known: some sampling request has top-k / top-p on

    @property
    def num_reqs(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def is_decode(self) -> bool:
        return self.token_ids is None

    def padded(self, size: int, scratch_slot: int, scratch_block: int, block_size: int) -> StepBatch:
        """This decode batch grown to ``size`` requests with padding requests (see the module docstring)."""
        pad = size - self.num_reqs
        if not self.is_decode or pad < 0:
            kind = "decode" if self.is_decode else "prefill"
            raise ValueError(f"can only pad a decode batch up: a {kind} batch of {self.num_reqs} requests -> {size}")
        if pad == 0:
            return self
        return replace(
            self,
            slots=self.slots + [scratch_slot] * pad,
            positions=self.positions + [0] * pad,
            slot_mapping=self.slot_mapping + [scratch_block * block_size] * pad,
            query_lens=self.query_lens + [1] * pad,
            seq_lens=self.seq_lens + [1] * pad,
            block_tables=self.block_tables + [[scratch_block]] * pad,
        )

    def padded_prefill(
        self, tokens: int, reqs: int, scratch_slot: int, scratch_block: int, dump_block: int, block_size: int
    ) -> StepBatch:
        """This prefill batch grown to ``tokens`` tokens and ``reqs`` requests (see the module docstring);
        ``reqs`` leaves room for the padding request."""
        pad_t, empty = tokens - self.num_tokens, reqs - self.num_reqs - 1
        if self.is_decode or pad_t < 0 or empty < 0:
            kind = "decode" if self.is_decode else "prefill"
            raise ValueError(
                f"can only pad a prefill batch up, with room for the padding request: a {kind} batch of "
                f"{self.num_tokens} tokens / {self.num_reqs} requests -> {tokens} / {reqs}"
            )
        return replace(
            self,
            slots=self.slots + [scratch_slot] * (empty + 1),
            positions=self.positions + [0] * pad_t,
            slot_mapping=self.slot_mapping + [dump_block * block_size] * pad_t,
            query_lens=self.query_lens + [0] * empty + [pad_t],
            seq_lens=self.seq_lens + [0] * empty + [pad_t],
            block_tables=self.block_tables + [[]] * empty + [[scratch_block] * -(-pad_t // block_size)],
            token_ids=self.token_ids + [0] * pad_t,
        )

    def prefill_packed(self) -> Tensor:
        """[2 N + 2 B] int64 CPU: token ids, positions, each request's last token and slot of a prefill batch
        (one host-to-device copy)."""
        ends = torch.tensor(self.query_lens, dtype=torch.long).cumsum(0) - 1
        ints = torch.tensor(self.token_ids + self.positions + self.slots, dtype=torch.long)
        n = self.num_tokens
        return torch.cat([ints[: 2 * n], ends.clamp(min=0), ints[2 * n :]])

    def decode_packed(self) -> Tensor:
        """[2, B] int64 CPU: slots and positions of a decode batch (one host-to-device copy)."""
        return torch.tensor([self.slots, self.positions], dtype=torch.long)

    def to_device(self, device: torch.device) -> DeviceBatch:
        if self.is_decode:
            return DeviceBatch.decode(self.decode_packed().to(device, non_blocking=True), self.draw, self.filter)
        packed = self.prefill_packed().to(device, non_blocking=True)
        return DeviceBatch.prefill(packed, self.num_tokens, *self.audio_to(device), draw=self.draw, filter=self.filter)

    def audio_to(self, device: torch.device) -> tuple[Tensor, Tensor | None]:
        """A prefill's (audio_index [M], audio_codes [M, C] or None) int64 on ``device``."""
        index = torch.tensor(self.audio_index, dtype=torch.long).to(device, non_blocking=True)
        codes = self.audio_codes
        return index, None if codes is None else codes.to(device, torch.long, non_blocking=True)


@dataclass(frozen=True)
class DeviceBatch:
    """A step's device tensors. Decode: ``slots`` and ``positions`` [B] only, views of one [2, B] buffer (a
    full-decode graph's static inputs are such views). Prefill: the integer inputs are views of one buffer too
    (``StepBatch.prefill_packed``); ``embeds`` [N, H], when given, replaces embedding the tokens (a prefill
    graph embeds outside the graph, where the number of audio rows may vary)."""

    slots: Tensor  # [B] int64
    positions: Tensor  # [N] int64
    token_ids: Tensor | None = None  # prefill: [N] int64
    audio_index: Tensor | None = None  # prefill: [M] int64
    audio_codes: Tensor | None = None  # prefill: [M, C] int64
    last_token: Tensor | None = None  # prefill: [B] int64, the token each request samples from
    embeds: Tensor | None = None  # prefill: [N, H], already embedded
    draw: bool = True
    filter: bool = True

    @classmethod
    def decode(cls, packed: Tensor, draw: bool = True, filter: bool = True) -> DeviceBatch:
        """Decode inputs whose tensors are the rows of ``packed`` [2, B] int64 (slots, positions)."""
        return cls(slots=packed[0], positions=packed[1], draw=draw, filter=filter)

    @classmethod
    def prefill(
        cls,
        packed: Tensor,
        num_tokens: int,
        audio_index: Tensor | None = None,
        audio_codes: Tensor | None = None,
        embeds: Tensor | None = None,
        draw: bool = True,
        filter: bool = True,
    ) -> DeviceBatch:
        """Prefill inputs whose integer tensors are views of ``packed`` (``StepBatch.prefill_packed``)."""
        n = num_tokens
        b = (packed.shape[0] - 2 * n) // 2
        empty = packed[:0]
        return cls(
            slots=packed[2 * n + b :],
            positions=packed[n : 2 * n],
            token_ids=packed[:n],
            audio_index=empty if audio_index is None else audio_index,
            audio_codes=audio_codes,
            last_token=packed[2 * n : 2 * n + b],
            embeds=embeds,
            draw=draw,
            filter=filter,
        )

    @property
    def is_decode(self) -> bool:
        return self.token_ids is None
