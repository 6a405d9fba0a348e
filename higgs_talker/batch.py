"""One step's work: ``StepBatch`` (host lists, built by the scheduler) and ``DeviceBatch`` (what the model
runner and captured graphs read).

A step is a prefill (each request contributes a span of tokens: its prompt, or on resume its prompt plus every
fed-back row) or a decode (one token per request, embedded from the request's last frame). Shapes: B requests,
N tokens (N = B for decode), C codebooks. Vocabulary as in vLLM and FlashInfer: ``slot_mapping`` is the KV
cache slot (``block * block_size + offset``) of each token, ``block_tables`` each request's KV blocks,
``seq_lens`` each request's context after the step. ``slots`` are decode-state slots (``heads.slots``).

The one padding rule (``StepBatch.padded``): a decode batch grows to a graph bucket with requests of one token
at position 0 in the scratch decode-state slot, writing their K/V into the scratch KV block, which no request
owns; their context is that one token.
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

    def decode_packed(self) -> Tensor:
        """[2, B] int64 CPU: slots and positions of a decode batch (one host-to-device copy)."""
        return torch.tensor([self.slots, self.positions], dtype=torch.long)

    def to_device(self, device: torch.device) -> DeviceBatch:
        if self.is_decode:
            return DeviceBatch.decode(self.decode_packed().to(device, non_blocking=True), self.draw, self.filter)
        ends = torch.tensor(self.query_lens, dtype=torch.long).cumsum(0) - 1
        codes = self.audio_codes
        return DeviceBatch(
            slots=torch.tensor(self.slots, dtype=torch.long).to(device, non_blocking=True),
            positions=torch.tensor(self.positions, dtype=torch.long).to(device, non_blocking=True),
            token_ids=torch.tensor(self.token_ids, dtype=torch.long).to(device, non_blocking=True),
            audio_index=torch.tensor(self.audio_index, dtype=torch.long).to(device, non_blocking=True),
            audio_codes=None if codes is None else codes.to(device, torch.long, non_blocking=True),
            last_token=ends.to(device, non_blocking=True),
            draw=self.draw,
            filter=self.filter,
        )


@dataclass(frozen=True)
class DeviceBatch:
    """A step's device tensors. Decode: ``slots`` and ``positions`` [B] only, views of one [2, B] buffer (a
    full-decode graph's static inputs are such views)."""

    slots: Tensor  # [B] int64
    positions: Tensor  # [N] int64
    token_ids: Tensor | None = None  # prefill: [N] int64
    audio_index: Tensor | None = None  # prefill: [M] int64
    audio_codes: Tensor | None = None  # prefill: [M, C] int64
    last_token: Tensor | None = None  # prefill: [B] int64, the token each request samples from
    draw: bool = True
    filter: bool = True

    @classmethod
    def decode(cls, packed: Tensor, draw: bool = True, filter: bool = True) -> DeviceBatch:
        """Decode inputs whose tensors are the rows of ``packed`` [2, B] int64 (slots, positions)."""
        return cls(slots=packed[0], positions=packed[1], draw=draw, filter=filter)

    @property
    def is_decode(self) -> bool:
        return self.token_ids is None
