"""Per-request decode state for the vLLM adapter, keyed by request id (pure torch; vLLM is not imported).

vLLM's runner hands the model a batch in *its* order every step, and that order changes as requests join,
finish, get reordered (decode-first) or condensed. The state lives in fixed-storage pool rows ("slots")
assigned to a request id on first sight and freed when it finishes; each step the adapter gathers its
batch's slots, so no request's state ever moves. The storage is allocated once (graphs may capture it).

Per slot, besides the delay state (``heads.delay.DelayState``): the sampling seed, the number of rows the
request has produced (the sampling step, so seeded noise never repeats), and ``seed_pos``, the absolute
position of the prompt's last token (its ``<|audio|>``), from which the position every later row is due
at follows.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..heads.delay import DelayState
from ..heads.sampling import MAX_SEED


@dataclass
class HostRequest:
    """Host-side record of one live request: its slot and what it has produced so far."""

    slot: int
    seed: int
    rows: list[Tensor] = field(default_factory=list)  # each [N] int32 CPU, owned
    active: bool = False  # in an audio stream (mirrors has_codes after the last sample)
    done: bool = False  # terminal row emitted; the next text token is EOS


class RequestStatePool:
    """Fixed-size pool of decode-state slots keyed by request id.

    ``sync(req_ids)`` -> slots [B] int64 in batch order (allocating and resetting slots for new ids);
    ``release(ids)`` frees slots; a freed slot is reset on its next use (also for a reused id).
    """

    def __init__(
        self,
        capacity: int,
        num_codebooks: int,
        boc_id: int,
        device: torch.device | str = "cpu",
        keep_finished: int = 0,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"state pool capacity must be > 0, got {capacity}")
        self.capacity, self.num_codebooks, self.boc_id = capacity, num_codebooks, boc_id
        self.device = torch.device(device)
        self.state = DelayState.allocate(capacity, num_codebooks, boc_id, self.device)
        self.seeds = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self.num_rows = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self.seed_pos = torch.full((capacity,), -1, dtype=torch.long, device=self.device)
        self.requests: dict[str, HostRequest] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._last_ids: list[str] | None = None
        self._last_slots: Tensor | None = None
        # finished requests' rows, newest last (only kept when keep_finished > 0: the text-only vLLM path)
        self.keep_finished = keep_finished
        self.finished: OrderedDict[str, Tensor] = OrderedDict()

    def sync(self, req_ids: list[str], seeds: dict[int, int] | None = None) -> tuple[Tensor, list[int]]:
        """(slots [B] int64 for ``req_ids`` in batch order, batch indices of ids new this call).

        ``seeds`` maps batch index -> seed for new ids.

        New ids get a fresh slot (reset state, row count 0) and their seed, or a random one (no seed is
        pinned by default). Raises RuntimeError when more requests are live than the pool holds.
        """
        if self._last_slots is not None and req_ids == self._last_ids:
            return self._last_slots, []
        new: list[tuple[int, int]] = []  # (slot, seed)
        new_rows: list[int] = []
        for i, rid in enumerate(req_ids):
            if rid in self.requests:
                continue
            if not self._free:
                raise RuntimeError(
                    f"{len(self.requests) + 1} live requests exceed the decode-state pool of {self.capacity} slots "
                    "(raise max_num_seqs in the vLLM config)"
                )
            slot = self._free.pop()
            seed = (seeds or {}).get(i)
            seed = seed if seed is not None else secrets.randbelow(MAX_SEED)
            self.requests[rid] = HostRequest(slot, seed)
            new.append((slot, seed))
            new_rows.append(i)
        if new:
            idx = torch.tensor([s for s, _ in new], dtype=torch.long, device=self.device)
            self.state.reset(idx, self.boc_id)
            self.num_rows[idx] = 0
            self.seed_pos[idx] = -1
            self.seeds[idx] = torch.tensor([s for _, s in new], dtype=torch.long, device=self.device)
        slots = torch.tensor([self.requests[r].slot for r in req_ids], dtype=torch.long, device=self.device)
        self._last_ids, self._last_slots = list(req_ids), slots
        return slots, new_rows

    def set_seed(self, req_id: str, seed: int) -> None:
        """Replace a live request's sampling seed (vLLM hands a request's seed over at its first sample)."""
        req = self.requests[req_id]
        req.seed = seed
        self.seeds[req.slot] = seed

    def release(self, req_ids) -> None:
        """Free the slots of finished (or aborted) requests; unknown ids are ignored."""
        for rid in req_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self._free.append(req.slot)
            if self.keep_finished > 0:
                self.finished[rid] = self.rows_of(req)
                while len(self.finished) > self.keep_finished:
                    self.finished.popitem(last=False)
        self._last_ids, self._last_slots = None, None

    def rows_of(self, req: HostRequest) -> Tensor:
        """All rows a request produced, [R, N] int32 (R may be 0)."""
        if not req.rows:
            return torch.zeros(0, self.num_codebooks, dtype=torch.int32)
        return torch.stack(req.rows)

    def record(
        self, req_ids: list[str], rows: Tensor, valid: Tensor, active: Tensor, done: Tensor
    ) -> list[Tensor | None]:
        """Store one step's host results (batch order); returns per request an owned [1, N] row or None.

        rows [B, N] int32, valid/active/done [B] bool, all on the CPU.
        """
        out: list[Tensor | None] = []
        for i, rid in enumerate(req_ids):
            req = self.requests.get(rid)
            if req is None:
                out.append(None)
                continue
            req.active, req.done = bool(active[i]), bool(done[i])
            if bool(valid[i]):
                row = rows[i].clone()
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
