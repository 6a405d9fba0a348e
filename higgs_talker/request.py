"""What the engine keeps per request and per step: requests, their per-step outputs, engine settings, and the
device inputs of one decode step."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from torch import Tensor

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
    """Device inputs of one decode step (the tensors a full-decode graph captures), with host copies."""

    state_rows: Tensor  # [B] int64
    positions: Tensor  # [B] int64
    steps: Tensor  # [B] int64: row index each request is about to produce
    state_rows_host: list[int] = field(default_factory=list)
    positions_host: list[int] = field(default_factory=list)
    steps_host: list[int] = field(default_factory=list)
    draw: bool = True  # host-known: some row samples (temperature > 0); False: all greedy, skip the noise
    filter: bool = True  # host-known: some sampled row has top-k / top-p on; False: skip the sort
