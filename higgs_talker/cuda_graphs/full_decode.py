"""Full decode-step graphs: feedback embedding, every layer (FlashInfer decode), the codebook head, delay
masks, sampling and the state update, captured as one CUDA graph per padded batch bucket.

This is our engine's analogue of vLLM's FULL_DECODE_ONLY. Graphs are captured at warm-up, largest bucket
first, in one shared pool, with every row pointing at the engine's scratch state row and scratch KV block, so
capturing (and the warm-up run before it) touches no request's state. Each graph is replayed once right after
capture and its output compared with an eager run on the same inputs; a bucket that fails either step is
dropped with one warning and its batches run eagerly. Prefill steps never use these graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .buckets import bucket_for, normalize_buckets
from .capture import capture_graph, record_capture_failure
from .policy import local_graphs_allowed_now

if TYPE_CHECKING:
    from ..attention import AttnMetadata
    from ..engine import DecodeInputs, Engine


class _Slot:
    def __init__(self, size: int, packed: Tensor) -> None:
        from ..engine import DecodeInputs

        self.size = size
        self.packed = packed  # [3, size] int64: state rows, positions, steps
        self.inputs = DecodeInputs.static(packed)  # the static device inputs the graph reads (views of packed)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Tensor | None = None  # [size, N] int64, written by each replay


class FullDecodeGraphs:
    def __init__(self, engine: Engine, buckets: Sequence[int], pool=None) -> None:
        self.engine = engine
        self.requested = normalize_buckets(buckets)
        self.pool = pool
        self.slots: dict[int, _Slot] = {}
        self.failed: dict[int, str] = {}

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.slots))

    def bucket(self, batch: int) -> int | None:
        return bucket_for(batch, self.sizes)

    def padding_packed(self, size: int) -> Tensor:
        """[3, size] int64 device inputs of an all-padding batch (``DecodeInputs.padded``'s padding rows)."""
        from ..engine import DecodeInputs

        empty = DecodeInputs.from_host([], [], [])
        return empty.padded(size, self.engine.scratch_row).host_packed().to(self.engine.device)

    def padding_inputs(self, size: int) -> DecodeInputs:
        from ..engine import DecodeInputs

        return DecodeInputs.static(self.padding_packed(size))

    def capture(self, check: bool = True) -> None:
        if not local_graphs_allowed_now():
            raise RuntimeError("full decode graphs cannot be captured inside another capture")
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.requested, reverse=True):
            slot = _Slot(size, self.padding_packed(size))
            try:
                self._capture(slot)
                if check:
                    self._check(slot)
            except Exception as exc:  # noqa: BLE001 - any failure means: this bucket runs eagerly
                record_capture_failure(self.failed, "full decode graph", size, exc)
                continue
            self.slots[size] = slot

    def _capture(self, slot: _Slot) -> None:
        eng = self.engine
        eng.attn.begin_graph(None, slot.size)
        # the warm-up run before the capture touches the scratch rows only
        slot.graph, slot.out = capture_graph(lambda: eng.decode_forward(slot.inputs), self.pool)

    def _check(self, slot: _Slot) -> None:
        """Replay once and compare with eager on identical inputs and scratch state."""
        eng = self.engine
        rows = torch.tensor([eng.scratch_row], device=eng.device)
        saved = eng.state.gather(rows)
        eng.attn.begin_graph(None, slot.size)
        want = eng.decode_forward(slot.inputs).clone()
        eng.state.scatter(rows, saved)
        slot.graph.replay()
        eng.state.scatter(rows, saved)
        if not torch.equal(slot.out, want):
            raise RuntimeError(
                f"replay of bucket {slot.size} differs from eager: {slot.out.tolist()} vs {want.tolist()}"
            )

    def run(self, inputs: DecodeInputs, meta: AttnMetadata) -> Tensor:
        """Replay the graph of a decode batch already padded to one of ``sizes``; returns rows [Bp, N] (a view
        valid until the bucket's next replay)."""
        size = len(inputs.state_rows_host)
        slot = self.slots[size]
        # state_rows, positions, steps are the rows of one buffer: one copy refreshes all three
        slot.packed.copy_(inputs.host_packed(), non_blocking=True)
        self.engine.attn.begin_graph(meta, size)
        slot.graph.replay()
        return slot.out
