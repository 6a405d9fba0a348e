"""Per-request decode state in fixed device storage, and the frame step that both front ends use.

A *slot* holds one live request's decode state: its delay-pattern state (``DelayState``), its sampling
parameters and seed, the number of rows it has produced (the sampling step, so seeded noise never repeats)
and the row from which codebook 0 may end the stream. The engine's scheduler and the vLLM adapter hand slots
out from a ``FreeList`` and keep them for a request's whole life (preemption included), so no request's state
ever moves; the storage is allocated once and captured CUDA graphs may read it. One extra *scratch* slot
belongs to no request: padding rows of a graph bucket read and write it.

``sample_frame`` is the frame step: masked codebook logits -> sampled codes -> emitted row -> state update.
Shapes: B requests, C codebooks, V codebook entries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from . import fused
from .delay import DelayState, apply_delay_mask, update_state
from .sampling import sample_codes


@dataclass(frozen=True)
class SlotInit:
    """A fresh stream for ``slot``: the request's seed and sampling parameters (top_k <= 0: off)."""

    slot: int
    seed: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_rows: int = 0  # codebook 0 may sample EOC from this row index on


class FreeList:
    """Host-side slot ids ``0 .. capacity - 1``: each is free or held by exactly one request."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"slot capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.capacity} decode-state slots are in use")
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._held:
            raise RuntimeError(f"slot {slot} released but not held")
        self._held.remove(slot)
        self._free.append(slot)


_PER_SLOT = ("temperature", "top_p", "top_k", "seeds", "min_rows", "num_rows")  # per-slot tensors beside the state


class SlotStore:
    """Fixed device storage for ``capacity`` request slots plus the scratch slot (index ``capacity``)."""

    def __init__(
        self, capacity: int, num_codebooks: int, codebook_size: int, boc_id: int, eoc_id: int, device: torch.device
    ) -> None:
        self.capacity, self.scratch = capacity, capacity
        self.num_codebooks, self.codebook_size, self.boc_id, self.eoc_id = num_codebooks, codebook_size, boc_id, eoc_id
        self.device = device = torch.device(device)
        r = capacity + 1
        self.state = DelayState.allocate(r, num_codebooks, boc_id, device)
        # explicit dtypes throughout: vLLM builds models under its default dtype (e.g. bf16)
        self.temperature = torch.ones(r, dtype=torch.float32, device=device)
        self.top_p = torch.ones(r, dtype=torch.float32, device=device)
        self.top_k = torch.full((r,), codebook_size, dtype=torch.long, device=device)
        self.seeds = torch.zeros(r, dtype=torch.long, device=device)
        self.min_rows = torch.zeros(r, dtype=torch.long, device=device)
        self.num_rows = torch.zeros(r, dtype=torch.long, device=device)

    def reset(self, inits: Sequence[SlotInit]) -> None:
        """Start fresh streams in these slots: all-BOC feedback, no rows yet, their parameters (two copies)."""
        if not inits:
            return
        v = self.codebook_size
        dev = self.device
        # host tensors uploaded without blocking: a blocking copy would wait for the step queued ahead
        idx = torch.tensor([i.slot for i in inits], dtype=torch.long).to(dev, non_blocking=True)
        floats = torch.tensor([[i.temperature, i.top_p] for i in inits], dtype=torch.float32)
        floats = floats.to(dev, non_blocking=True)
        # top_k is clamped to V here only so that any int fits the tensor; sample_codes treats >= V as off
        ints = [[min(i.top_k, v) if i.top_k > 0 else v, i.seed, i.min_rows] for i in inits]
        ints = torch.tensor(ints, dtype=torch.long).to(dev, non_blocking=True)
        self.state.reset(idx, self.boc_id)
        self.temperature.index_copy_(0, idx, floats[:, 0])
        self.top_p.index_copy_(0, idx, floats[:, 1])
        self.top_k.index_copy_(0, idx, ints[:, 0])
        self.seeds.index_copy_(0, idx, ints[:, 1])
        self.min_rows.index_copy_(0, idx, ints[:, 2])
        self.num_rows.index_fill_(0, idx, 0)

    @contextmanager
    def preserved(self, slots: Sequence[int]) -> Iterator[None]:
        """Restore these slots' decode state and row counts on exit (warm-up and capture runs touch scratch)."""
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        state, rows = self.state.gather(idx), self.num_rows.index_select(0, idx)
        try:
            yield
        finally:
            self.state.scatter(idx, state)
            self.num_rows.index_copy_(0, idx, rows)

    def export(self, slot: int) -> dict[str, Tensor]:
        """One slot's whole decode state as CPU tensors (``load`` puts it back, possibly in another slot)."""
        idx = torch.tensor([slot], device=self.device)
        out = {f"state.{k}": v.cpu() for k, v in vars(self.state.gather(idx)).items()}
        for name in _PER_SLOT:
            out[name] = getattr(self, name).index_select(0, idx).cpu()
        return out

    def load(self, slot: int, data: dict[str, Tensor]) -> None:
        idx = torch.tensor([slot], device=self.device)
        fields = {k[len("state.") :]: v.to(self.device) for k, v in data.items() if k.startswith("state.")}
        self.state.scatter(idx, DelayState(**fields))
        for name in _PER_SLOT:
            getattr(self, name).index_copy_(0, idx, data[name].to(self.device))

    def params(self, slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The slots' own (temperature [B], top_k [B], top_p [B])."""
        return (
            self.temperature.index_select(0, slots),
            self.top_k.index_select(0, slots),
            self.top_p.index_select(0, slots),
        )


def masked_logits(logits: Tensor, state: DelayState, boc_id: int, eoc_id: int, eoc_allowed: Tensor) -> None:
    """``apply_delay_mask`` in place: one Triton kernel on CUDA once checked (``heads.fused``), else torch."""

    def reference(checking: bool) -> Tensor:
        out = logits.clone() if checking else logits
        return apply_delay_mask(out, state.delay, state.countdown, boc_id, eoc_id, eoc_allowed)

    if not fused.delay_mask_supports(logits):
        reference(False)
        return

    def kernel(k, checking: bool) -> Tensor:
        out = logits.clone() if checking else logits
        return k.delay_mask(out, state.delay, state.countdown, boc_id, eoc_id, eoc_allowed)

    key = (logits, state.delay, state.countdown, eoc_allowed, boc_id, eoc_id)
    out = fused.run_checked("delay mask", logits, kernel, reference, fused.same_values, key)
    if out is not logits:  # the first use, checked on copies
        logits.copy_(out)


def next_state(codes: Tensor, state: DelayState, active: Tensor, boc_id: int, eoc_id: int) -> tuple[Tensor, DelayState]:
    """``update_state``: one Triton kernel on CUDA once checked (``heads.fused``), else torch."""

    def same(a: tuple[Tensor, DelayState], b: tuple[Tensor, DelayState]) -> bool:
        return fused.same_values(a[0], b[0]) and all(
            fused.same_values(getattr(a[1], f.name), getattr(b[1], f.name)) for f in fields(DelayState)
        )

    return fused.run_checked(
        "delay state update", codes, lambda k, checking: k.update_state(codes, state, active, boc_id, eoc_id),
        lambda checking: update_state(codes, state, active, boc_id, eoc_id), same,
        (codes, active, boc_id, eoc_id, *(getattr(state, f.name) for f in fields(DelayState))),
    )  # fmt: skip


def sample_frame(
    store: SlotStore,
    slots: Tensor,
    logits: Tensor,
    *,
    params: tuple[Tensor, Tensor, Tensor] | None = None,
    active: Tensor | None = None,
    fresh: Tensor | None = None,
    draw: bool = True,
    filter: bool = True,
) -> tuple[Tensor, DelayState]:
    """One frame for the requests in ``slots`` [B] int64 from their codebook logits [B, C, V] fp32 (masked in
    place). Returns the emitted rows [B, C] int64 (-1 where not ``active``) and their new state; the slots are
    advanced in place (graph-safe: no host sync).

    params: (temperature, top_k, top_p) [B] each, default the slots' own (vLLM passes its per-step values).
    active [B] bool: rows that produce a frame this step (default all). fresh [B] bool: rows whose stream
    starts over now, before sampling (vLLM: a prompt tail reaching ``<|audio|>``, or a closed stream).
    draw/filter: host-known shortcuts of ``sample_codes`` (all greedy / no top-k/top-p in the batch).
    """
    state = store.state.gather(slots)
    steps = store.num_rows.index_select(0, slots)
    if fresh is not None:
        state = state.where_fresh(fresh, store.boc_id)
        steps = torch.where(fresh, 0, steps)
    eoc_allowed = steps >= store.min_rows.index_select(0, slots)  # steps: the row index about to be produced
    masked_logits(logits, state, store.boc_id, store.eoc_id, eoc_allowed)
    temperature, top_k, top_p = params if params is not None else store.params(slots)
    seeds = store.seeds.index_select(0, slots)
    codes = sample_codes(logits, temperature, top_k, top_p, seeds, steps, draw=draw, filter=filter)
    if active is None:
        active = torch.ones_like(state.done)
    emitted, new = next_state(codes, state, active, store.boc_id, store.eoc_id)
    store.state.scatter(slots, new)
    store.num_rows.index_copy_(0, slots, steps + active.long())
    return emitted, new
