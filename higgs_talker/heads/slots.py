"""Per-request decode state in fixed device storage, and the frame step that both front ends use.

A *slot* holds one live request's decode state: its delay-pattern state (``DelayState``), its sampling
parameters and seed, the number of rows it has produced (the sampling step, so seeded noise never repeats)
and the row from which codebook 0 may end the stream. The engine's scheduler and the vLLM adapter hand slots
out from a ``FreeList`` and keep them for a request's whole life (preemption included), so no request's state
ever moves; the storage is allocated once and captured CUDA graphs may read it. One extra *scratch* slot
belongs to no request: padding rows of a graph bucket read and write it.

``sample_frame`` is the frame step: masked codebook logits -> sampled codes -> emitted row -> state update.
Shapes: B requests, C codebooks, V codebook entries. ``HostCopy`` brings a step's results to the host behind the
step on the device stream, so the host can prepare the next step before this one has run.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from . import fused
from .delay import DelayState, apply_delay_mask, update_state
from .sampling import resolve_seed, sample_codes


class HostCopy:
    """A device tensor's copy on the host, taken behind the work queued on the stream (into pinned memory, without
    waiting); ``wait()`` returns it once the device got there. A CPU tensor is its own copy."""

    def __init__(self, value: Tensor) -> None:
        if value.device.type == "cuda":
            self.value = value.to("cpu", non_blocking=True)
            self.ready: torch.cuda.Event | None = torch.cuda.Event()
            self.ready.record()
        else:
            self.value, self.ready = value, None

    def wait(self) -> Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.value


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

    @classmethod
    def for_config(cls, cfg, capacity: int, device: torch.device) -> SlotStore:
        """Storage for ``capacity`` requests of a ``TalkerConfig``'s codebooks."""
        return cls(capacity, cfg.num_codebooks, cfg.codebook_size, cfg.boc_id, cfg.eoc_id, device)

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

    def kernel(k, checking: bool) -> Tensor:
        out = logits.clone() if checking else logits
        return k.delay_mask(out, state.delay, state.countdown, boc_id, eoc_id, eoc_allowed)

    key = (logits, state.delay, state.countdown, eoc_allowed, boc_id, eoc_id)
    out = fused.run_checked("delay mask", logits, kernel, reference, fused.same_values, key,
                            supported=lambda: fused.delay_mask_supports(logits))  # fmt: skip
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


# ---------------------------------------------------------------------------------------------------------
# slots keyed by a front end's request ids (the vLLM adapter): vLLM hands the model a batch in its own order each
# step, so a request gets a slot on first sight and keeps it until it is released; ``seed_pos`` is the position
# of the prompt tail that opened a request's stream (the positions of its later rows follow from it). A released
# request's state can be kept (``release(keep=True)``) and loaded back when it resumes after a preemption.


@dataclass
class HostRequest:
    """Host-side record of one live request: its slot and what it has produced so far."""

    slot: int
    seed: int
    rows: list[Tensor] = field(default_factory=list)  # each [1, C] int32 CPU: a view of its step's one host copy
    shipped: int = 0  # how many of ``rows`` were handed on (``RequestSlots.ship``)
    active: bool = False  # in an audio stream (mirrors has_codes after the last sample)
    done: bool = False  # terminal row emitted; the next text token is EOS
    # a voice clone whose prompt marks its rows with placeholder tokens (heads.spans.placeholder_positions): the
    # run's first prompt position once known, and the last token of the request's latest prefill chunk
    reference_start: int | None = None
    prompt_tail: int | None = None


class RequestSlots:
    """Slots of one ``SlotStore`` keyed by vLLM request id (capacity: the store's).

    A sampled step's results reach the host records later (``record_later``): its host copy is taken behind the
    step and recorded by ``settle``, which every read of the host records (rows, modes, a kept release) does
    first, so the host may prepare the next step while this one runs and no reader sees a record a step old.
    """

    def __init__(self, store: SlotStore, keep_finished: int = 0, seed: int | None = None) -> None:
        """``seed`` draws the sampling seeds of requests that bring none: the same sequence on every tensor-
        parallel rank (vLLM's model seed, as vLLM seeds its own sampler), so the ranks sample the same codes and
        feed the same rows back; None draws them from the OS."""
        self.store = store
        self._seeds = random.Random(seed) if seed is not None else random.SystemRandom()
        self.free = FreeList(store.capacity)
        self.seed_pos = torch.full((store.capacity + 1,), -1, dtype=torch.long, device=store.device)
        self.requests: dict[str, HostRequest] = {}
        self._last: tuple[list[str], Tensor] | None = None
        # requests vLLM took out of the batch, newest last (only kept when keep_finished > 0: the text-only vLLM
        # path, where a removal is a finish or a preemption and vLLM does not say which): their rows, and the
        # slot's decode state when it was kept for a resume
        self.keep_finished = keep_finished
        self.finished: OrderedDict[str, tuple[HostRequest, dict[str, Tensor] | None]] = OrderedDict()
        self._pending: tuple[list[str | None], HostCopy] | None = None  # a sampled step on its way to the host

    def sync(
        self,
        req_ids: list[str],
        seeds: dict[int, int] | None = None,
        min_rows: dict[int, int] | None = None,
        resume: set[str] | None = None,
    ) -> tuple[Tensor, list[int]]:
        """(slots [B] int64 for ``req_ids`` in batch order, batch indices of the ids new this call).

        New ids get a fresh slot with ``seeds[batch index]`` or the next seed of the unseeded draw, and
        ``min_rows[batch index]``: no end of stream before that many rows. An id in ``resume`` whose state was
        kept (``release(keep=True)``) gets it back instead: a preempted request goes on where it stopped.
        Raises RuntimeError when more requests are live than there are slots.
        """
        if self._last is not None and req_ids == self._last[0]:
            return self._last[1], []
        inits, new_rows = [], []
        for i, rid in enumerate(req_ids):
            if rid in self.requests:
                continue
            if not self.free.num_free:
                raise RuntimeError(
                    f"{len(self.requests) + 1} live requests exceed the {self.free.capacity} decode-state slots "
                    "(raise max_num_seqs in the vLLM config)"
                )
            kept = self.finished.pop(rid, None) if rid in (resume or ()) else None
            if kept is not None and kept[1] is not None:
                req, snapshot = kept
                req.slot = self.free.acquire()
                self.store.load(req.slot, snapshot)
                self.seed_pos[req.slot] = snapshot["seed_pos"].to(self.seed_pos.device)[0]
                self.requests[rid] = req
                continue
            req = HostRequest(self.free.acquire(), resolve_seed((seeds or {}).get(i), self._seeds))
            self.requests[rid] = req
            inits.append(SlotInit(req.slot, req.seed, min_rows=(min_rows or {}).get(i, 0)))
            new_rows.append(i)
        if inits:
            self.store.reset(inits)
            fresh = torch.tensor([i.slot for i in inits]).to(self.seed_pos.device, non_blocking=True)
            self.seed_pos.index_fill_(0, fresh, -1)
        # non-blocking: a blocking host-to-device copy would wait for the step still running before this one
        slots = torch.tensor([self.requests[r].slot for r in req_ids], dtype=torch.long)
        slots = slots.to(self.store.device, non_blocking=True)
        self._last = (list(req_ids), slots)
        return slots, new_rows

    def set_seed(self, req_id: str, seed: int) -> None:
        """Replace a live request's sampling seed (vLLM hands a request's seed over at its first sample)."""
        req = self.requests[req_id]
        req.seed = seed
        self.store.seeds[req.slot] = seed

    def release(self, req_ids, keep: bool = False) -> None:
        """Free the slots of requests vLLM finished (or took out of the batch); unknown ids are ignored. With
        ``keep`` (and ``keep_finished``) a slot's decode state is kept for a resume. Only kept requests wait for
        a step still on its way (their rows are read later); the rows of the others are dropped with them."""
        req_ids = list(req_ids)
        if self.keep_finished > 0:
            self.settle()
        elif self._pending is not None:  # a later request that reuses an id must not get these rows
            ids, copy = self._pending
            gone = set(req_ids)
            self._pending = ([None if rid in gone else rid for rid in ids], copy)
        for rid in req_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            snapshot = None
            if keep and self.keep_finished > 0:
                snapshot = self.store.export(req.slot) | {
                    "seed_pos": self.seed_pos[req.slot : req.slot + 1].cpu().clone()
                }
            self.free.release(req.slot)
            if self.keep_finished > 0:
                self.finished[rid] = (req, snapshot)
                while len(self.finished) > self.keep_finished:
                    self.finished.popitem(last=False)
        self._last = None

    def rows_for(self, req_id: str) -> Tensor | None:
        """Every row [R, C] int32 request ``req_id`` produced, live or among the kept finished ones; None if unknown."""
        self.settle()
        req = self.requests.get(req_id)
        if req is None and req_id in self.finished:
            req = self.finished[req_id][0]
        return self.rows_of(req) if req is not None else None

    def rows_by_key(self, keys: Sequence[str]) -> dict[str, list | None]:
        """``rows_for`` of each key as nested lists (a worker's answer to a remote caller), None where unknown."""
        rows = {k: self.rows_for(k) for k in keys}
        return {k: None if r is None else r.tolist() for k, r in rows.items()}

    def rows_of(self, req: HostRequest) -> Tensor:
        """All rows a request produced, [R, C] int32 (R may be 0)."""
        if not req.rows:
            return torch.zeros(0, self.store.num_codebooks, dtype=torch.int32)
        return torch.cat(req.rows)

    def record(self, req_ids: list[str], host: Tensor) -> list[Tensor | None]:
        """Store one step's host results (batch order): host [B, C + 3] int32 CPU = codes, then the valid,
        active and done flags. Returns per request its [1, C] row, or None where no frame was produced: views of one
        copy of the step's codes, which nothing writes to (one copy and one host read a step, not a few per row)."""
        n = self.store.num_codebooks
        host = host[: len(req_ids)]
        flags, rows = host[:, n:].tolist(), host[:, None, :n].clone().unbind(0)
        out: list[Tensor | None] = []
        for rid, (valid, active, done), row in zip(req_ids, flags, rows, strict=True):
            req = self.requests.get(rid)
            if req is None:
                out.append(None)
                continue
            req.active, req.done = bool(active), bool(done)
            if valid:
                req.rows.append(row)
                out.append(row)
            else:
                out.append(None)
        return out

    def record_later(self, req_ids: list[str], results: Tensor) -> None:
        """``record`` one step's results [B, C + 3] int32 (on the device) once they reach the host: their copy is
        started now, behind the step, and ``settle`` records it. A step before it still on its way is settled
        first."""
        self.settle()
        self._pending = (list(req_ids), HostCopy(results))

    def settle(self) -> list[Tensor | None] | None:
        """Record the step on its way to the host (waiting for the device to finish it); returns ``record``'s rows,
        or None when no step was pending."""
        if self._pending is None:
            return None
        (req_ids, copy), self._pending = self._pending, None
        return self.record(req_ids, copy.wait())

    def ship(self, req_ids: list[str | None]) -> list[Tensor | None]:
        """Per request (batch order) the rows [R, C] int32 it produced since its last ship, or None where none (or
        the request is unknown or None): what a runner hands on to the next stage, each row once. The rows are the
        caller's (one copy of all of them, split by request: no tensor op per request), not views of our records."""
        self.settle()
        picked: list[list[Tensor]] = []
        for rid in req_ids:
            req = self.requests.get(rid)
            rows = req.rows[req.shipped :] if req is not None else []
            if rows:
                req.shipped = len(req.rows)
            picked.append(rows)
        new = [row for rows in picked for row in rows]
        parts = iter(torch.cat(new).split([len(rows) for rows in picked if rows]) if new else ())
        return [next(parts) if rows else None for rows in picked]

    def all_forced(self, req_ids: list[str]) -> bool:
        """True when every request is known (host side) to be in audio mode: its text token is forced."""
        self.settle()
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or not (req.active or req.done):
                return False
        return True


def merge_rows(per_engine: list[list[dict]], keys: Sequence[str]) -> dict[str, Tensor | None]:
    """Rows [R, C] int32 by key from each engine's ``rows_by_key`` answers, one per worker. An engine's tensor-
    parallel ranks hold the same rows (replicated heads, the same seeds) and a request lives on one data-parallel
    engine: RuntimeError otherwise. None for a key no engine knows."""
    merged: dict[str, list | None] = dict.fromkeys(keys)
    for index, (first, *others) in enumerate(per_engine):
        for rank, other in enumerate(others, start=1):
            for k in keys:
                if other[k] != first[k]:
                    raise RuntimeError(f"tensor-parallel rank {rank} holds other rows than rank 0 for request {k!r}")
        for k in keys:
            if first[k] is not None and merged[k] is not None:
                raise RuntimeError(f"request {k!r} has rows on data-parallel engine {index} and an earlier one")
            merged[k] = first[k] if first[k] is not None else merged[k]
    return {k: None if r is None else torch.tensor(r, dtype=torch.int32) for k, r in merged.items()}
