"""What the engine keeps per request and per step: requests, their per-step outputs, engine settings, and the
device inputs of one decode step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import torch
from torch import Tensor

from .cuda_graphs.buckets import pad_to
from .heads.sampling import SamplingParams
from .prompt import Prompt


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    id: str
    prompt: Prompt
    params: SamplingParams
    seed: int
    status: Status = Status.WAITING
    state_row: int = -1
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    rows: list[Tensor] = field(default_factory=list)  # emitted delayed rows, each [N] int32 (CPU)
    finish_reason: str | None = None
    submitted_at: float = 0.0
    first_row_at: float | None = None
    finished_at: float | None = None
    prefill_ms: float = 0.0
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence so far: the prompt plus one per emitted row after the first."""
        return len(self.prompt) + max(len(self.rows) - 1, 0)


@dataclass(frozen=True)
class StepOutput:
    """One request's result of one step: the row it just produced (owned), and whether it finished."""

    request_id: str
    row: Tensor | None  # [1, N] int32 CPU, or None when the step produced no row
    finished: bool
    finish_reason: str | None = None


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64
    block_size: int = 16
    num_blocks: int | None = None  # None: enough for max_num_seqs sequences of max_model_len
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_prefill_tokens: int = 8192
    kv_memory_fraction: float = 0.6  # CUDA: share of the free memory the default KV cache may take

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {self.num_blocks}")
        if not 0 < self.kv_memory_fraction <= 0.95:
            raise ValueError(f"kv_memory_fraction must lie in (0, 0.95], got {self.kv_memory_fraction}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")


@dataclass
class DecodeInputs:
    """One decode step's per-row inputs: host lists, and the device tensors a step (or a captured graph) reads.

    The device tensors are ``None`` until ``to_device`` uploads all three in one host-to-device copy; a graph's
    static inputs are views of one packed ``[3, B]`` tensor, refreshed with one copy per replay.
    """

    state_rows: Tensor | None  # [B] int64
    positions: Tensor | None  # [B] int64
    steps: Tensor | None  # [B] int64: row index each request is about to produce
    state_rows_host: list[int] = field(default_factory=list)
    positions_host: list[int] = field(default_factory=list)
    steps_host: list[int] = field(default_factory=list)
    draw: bool = True  # host-known: some row samples (temperature > 0); False: all greedy, skip the noise
    filter: bool = True  # host-known: some sampled row has top-k / top-p on; False: skip the sort

    @classmethod
    def from_host(
        cls, rows: list[int], positions: list[int], steps: list[int], draw: bool = True, filter: bool = True
    ) -> DecodeInputs:
        return cls(None, None, None, list(rows), list(positions), list(steps), draw, filter)

    @classmethod
    def static(cls, packed: Tensor) -> DecodeInputs:
        """Inputs whose device tensors are the rows of ``packed`` [3, B] int64 (a graph's fixed buffers)."""
        return cls(packed[0], packed[1], packed[2])

    def host_packed(self) -> Tensor:
        """[3, B] int64 CPU tensor of the host lists (rows, positions, steps)."""
        return torch.tensor([self.state_rows_host, self.positions_host, self.steps_host], dtype=torch.long)

    def to_device(self, device: torch.device) -> DecodeInputs:
        """These inputs with device tensors (one copy); ``self`` when they are already there."""
        if self.state_rows is not None:
            return self
        packed = self.host_packed().to(device, non_blocking=True)
        return replace(self, state_rows=packed[0], positions=packed[1], steps=packed[2])

    def padded(self, size: int, scratch_row: int) -> DecodeInputs:
        """Host-only inputs padded to ``size`` rows; padding rows use ``scratch_row``, position 0, step 0."""
        pad = size - len(self.state_rows_host)
        if pad < 0:
            raise ValueError(f"cannot pad a batch of {len(self.state_rows_host)} rows down to {size}")
        return DecodeInputs.from_host(
            pad_to(self.state_rows_host, size, scratch_row),
            pad_to(self.positions_host, size, 0),
            pad_to(self.steps_host, size, 0),
            self.draw,
            self.filter,
        )
