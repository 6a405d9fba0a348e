"""vLLM request ids -> the core's decode-state slots (``heads.slots.SlotStore``), plus each request's host record.

vLLM hands the model a batch in *its* order every step, and that order changes as requests join, finish, get
reordered (decode-first) or condensed. A request gets a slot on first sight and keeps it until vLLM reports it
finished; each step the adapter gathers its batch's slots, so no request's state ever moves.

One thing here is vLLM-specific: ``seed_pos``, the absolute position of the prompt tail that opened a stream,
from which the position every later row is due at follows (so a partial prefill chunk never advances one).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..heads.sampling import resolve_seed
from ..heads.slots import FreeList, SlotInit, SlotStore


@dataclass
class HostRequest:
    """Host-side record of one live request: its slot and what it has produced so far."""

    slot: int
    seed: int
    rows: list[Tensor] = field(default_factory=list)  # each [C] int32 CPU, owned
    active: bool = False  # in an audio stream (mirrors has_codes after the last sample)
    done: bool = False  # terminal row emitted; the next text token is EOS


class RequestSlots:
    """Slots of one ``SlotStore`` keyed by vLLM request id (capacity: the store's)."""

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
            self.seed_pos.index_fill_(0, torch.tensor([i.slot for i in inits], device=self.seed_pos.device), -1)
        slots = torch.tensor([self.requests[r].slot for r in req_ids], dtype=torch.long, device=self.store.device)
        self._last = (list(req_ids), slots)
        return slots, new_rows

    def set_seed(self, req_id: str, seed: int) -> None:
        """Replace a live request's sampling seed (vLLM hands a request's seed over at its first sample)."""
        req = self.requests[req_id]
        req.seed = seed
        self.store.seeds[req.slot] = seed

    def release(self, req_ids, keep: bool = False) -> None:
        """Free the slots of requests vLLM finished (or took out of the batch); unknown ids are ignored. With
        ``keep`` (and ``keep_finished``) a slot's decode state is kept for a resume."""
        for rid in req_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            snapshot = None
            if keep and self.keep_finished > 0:
                snapshot = self.store.export(req.slot) | {"seed_pos": self.seed_pos[req.slot : req.slot + 1].cpu()}
            self.free.release(req.slot)
            if self.keep_finished > 0:
                self.finished[rid] = (req, snapshot)
                while len(self.finished) > self.keep_finished:
                    self.finished.popitem(last=False)
        self._last = None

    def rows_of(self, req: HostRequest) -> Tensor:
        """All rows a request produced, [R, C] int32 (R may be 0)."""
        if not req.rows:
            return torch.zeros(0, self.store.num_codebooks, dtype=torch.int32)
        return torch.stack(req.rows)

    def record(self, req_ids: list[str], host: Tensor) -> list[Tensor | None]:
        """Store one step's host results (batch order): host [B, C + 3] int32 CPU = codes, then the valid,
        active and done flags. Returns per request an owned [1, C] row, or None where no frame was produced."""
        n = self.store.num_codebooks
        out: list[Tensor | None] = []
        for i, rid in enumerate(req_ids):
            req = self.requests.get(rid)
            if req is None:
                out.append(None)
                continue
            valid, active, done = (bool(x) for x in host[i, n:].tolist())
            req.active, req.done = active, done
            if valid:
                row = host[i, :n].clone()
                req.rows.append(row)
                out.append(row[None, :].clone())
            else:
                out.append(None)
        return out

    def all_forced(self, req_ids: list[str]) -> bool:
        """True when every request is known (host side) to be in audio mode: its text token is forced."""
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or not (req.active or req.done):
                return False
        return True
