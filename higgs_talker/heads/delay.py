"""The MusicGen delay pattern: per-row state, logit masks and the state update (SPEC 4.5, 4.7, 8).

Codebook ``c`` lags ``c`` steps. A stream's delayed rows, with ``s`` the step at which codebook 0 samples
EOC (C = num_codebooks, shown for C = 8)::

    row t < 7      codebooks > t are BOC (ramp-up)
    row s          [EOC, real x 7]                                  countdown becomes 7
    row s + j      codebooks < max(j, 1) are EOC, the rest real     j = 1 .. 7
    row s + 7      the terminal row: ``done`` (the next text token is EOS)

State per row (dense tensors, indexed by decode-state slot, ``heads.slots``): ``last_codes [R, C]`` (feedback
for the next step), ``has_codes [R]``, ``delay [R]`` (ramp-up progress 0..C-1), ``countdown [R]`` (-1 normal,
else ramp-down rows left) and ``done [R]``.

Where we differ from upstream (SPEC "deliberately differs" 7): if codebook 0 samples EOC before the ramp-up
finished (``s < C - 1``, an utterance shorter than C frames), the codebooks that have not started yet stay
BOC until their turn, so every codebook still follows the delay pattern. Upstream stops the BOC forcing
when the ramp-down starts and lets those codebooks sample real codes. For ``s >= C - 1`` both agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class DelayState:
    """Dense decode state rows with fixed storage (graphs may capture these tensors)."""

    last_codes: Tensor  # [R, C] int64
    has_codes: Tensor  # [R] bool
    delay: Tensor  # [R] int64
    countdown: Tensor  # [R] int64
    done: Tensor  # [R] bool

    @classmethod
    def allocate(cls, rows: int, num_codebooks: int, boc_id: int, device: torch.device | str = "cpu") -> DelayState:
        return cls(
            last_codes=torch.full((rows, num_codebooks), boc_id, dtype=torch.long, device=device),
            has_codes=torch.zeros(rows, dtype=torch.bool, device=device),
            delay=torch.zeros(rows, dtype=torch.long, device=device),
            countdown=torch.full((rows,), -1, dtype=torch.long, device=device),
            done=torch.zeros(rows, dtype=torch.bool, device=device),
        )

    def reset(self, rows: Tensor, boc_id: int) -> None:
        """Re-initialise ``rows`` [K] in place: a fresh stream (all-BOC last frame, no codes yet)."""
        self.last_codes[rows] = boc_id
        self.has_codes[rows] = False
        self.delay[rows] = 0
        self.countdown[rows] = -1
        self.done[rows] = False

    def where_fresh(self, fresh: Tensor, boc_id: int) -> DelayState:
        """This batch-ordered state with the rows where ``fresh`` [B] bool set back to a new stream."""
        return DelayState(
            last_codes=torch.where(fresh[:, None], boc_id, self.last_codes),
            has_codes=self.has_codes & ~fresh,
            delay=torch.where(fresh, 0, self.delay),
            countdown=torch.where(fresh, -1, self.countdown),
            done=self.done & ~fresh,
        )

    def gather(self, rows: Tensor) -> DelayState:
        """The state of ``rows`` [B] as new tensors (batch order)."""
        return DelayState(**{f.name: getattr(self, f.name).index_select(0, rows) for f in fields(self)})

    def scatter(self, rows: Tensor, new: DelayState) -> None:
        """Write batch-ordered ``new`` back into ``rows`` [B] in place (storage never changes)."""
        for f in fields(self):
            getattr(self, f.name).index_copy_(0, rows, getattr(new, f.name))


def apply_delay_mask(
    logits: Tensor, delay: Tensor, countdown: Tensor, boc_id: int, eoc_id: int, eoc_allowed: Tensor | None = None
) -> Tensor:
    """Mask codebook logits [B, C, V] in place by each row's delay/ramp state; returns ``logits``.

    Not-started codebooks may only emit BOC; codebooks locked by the ramp-down only EOC; during the
    ramp-down the other codebooks emit real codes only; otherwise real codes, plus EOC on codebook 0 where
    ``eoc_allowed`` [B] bool (default: every row) lets the stream end (``SamplingParams.min_frames``).
    """
    b, n, v = logits.shape
    q = torch.arange(n, device=logits.device)
    started = q[None, :] < (delay + 1).clamp(max=n)[:, None]  # [B, C]
    ramp = countdown >= 0
    locked = ramp[:, None] & (q[None, :] < (n - countdown)[:, None])
    eoc_free = started & ~ramp[:, None] & (q[None, :] == 0)
    if eoc_allowed is not None:
        eoc_free = eoc_free & eoc_allowed[:, None]
    force = torch.where(~started, boc_id, torch.where(locked, eoc_id, -1))  # [B, C]; -1: not forced
    vocab = torch.arange(v, device=logits.device)
    free = (vocab != boc_id) & ((vocab != eoc_id) | eoc_free[..., None])  # [B, C, V]
    allowed = torch.where((force >= 0)[..., None], vocab == force[..., None], free)
    return logits.masked_fill_(~allowed, float("-inf"))


def update_state(
    codes: Tensor, state: DelayState, active: Tensor, boc_id: int, eoc_id: int
) -> tuple[Tensor, DelayState]:
    """Advance the delay state by one sampled frame.

    codes [B, C] int64 (sampled under ``apply_delay_mask``), ``state`` batch-ordered, ``active`` [B] bool
    (rows that produce a frame this step). Returns the emitted row [B, C] (-1 where inactive) and the new
    batch-ordered state (inactive rows unchanged).
    """
    n = codes.shape[1]
    q = torch.arange(n, device=codes.device)
    ramp = state.countdown >= 0
    # 1. ramp-up: codebooks that have not started are BOC (also during a ramp-down: see module docstring)
    ramping_up = state.delay + 1 < n
    codes = torch.where(ramping_up[:, None] & (q[None, :] > state.delay[:, None]), boc_id, codes)
    delay = torch.where(ramping_up, state.delay + 1, state.delay)
    # 2. ramp-down lock
    locked = ramp[:, None] & (q[None, :] < (n - state.countdown)[:, None])
    codes = torch.where(locked, eoc_id, codes)
    # 3. new EOC on a normal row: everything up to the last EOC codebook becomes EOC
    is_eoc = (codes == eoc_id) & ~ramp[:, None]
    last = torch.where(is_eoc, q[None, :], -1).amax(dim=1)  # [B]
    codes = torch.where(q[None, :] <= last[:, None], eoc_id, codes)
    countdown = torch.where(ramp, state.countdown - 1, torch.where(last >= 0, n - last - 1, -1))
    # 4. terminal row
    done = (countdown == 0) & active
    delay = torch.where(done, 0, delay)
    countdown = torch.where(done, -1, countdown)
    a = active
    new = DelayState(
        last_codes=torch.where(a[:, None], codes, state.last_codes),
        has_codes=torch.where(a, ~done, state.has_codes),
        delay=torch.where(a, delay, state.delay),
        countdown=torch.where(a, countdown, state.countdown),
        done=torch.where(a, done, state.done),
    )
    return torch.where(a[:, None], codes, -1), new


def forced_text_tokens(done: Tensor, audio_id: int, eos_id: int) -> Tensor:
    """The text token of audio-mode rows: ``<|audio|>``, or EOS after the terminal row. done [B] -> [B] int64."""
    return torch.where(done, eos_id, audio_id).long()


# ---------------------------------------------------------------------------------------------------------
# host-side pattern arithmetic


def apply_delay_pattern(codes: Tensor, boc_id: int, eoc_id: int) -> Tensor:
    """Aligned frames [T, C] -> delayed rows [T + C - 1, C] (SPEC 3.2): column c is BOC x c, codes, EOC."""
    if codes.dim() != 2:
        raise ValueError(f"codes must be [frames, num_codebooks], got shape {list(codes.shape)}")
    t, n = codes.shape
    out = torch.full((t + n - 1, n), eoc_id, dtype=codes.dtype)
    for c in range(n):
        out[:c, c] = boc_id
        out[c : c + t, c] = codes[:, c]
    return out


def revert_delay_pattern(rows: Tensor) -> Tensor:
    """Delayed rows [R, C] -> aligned frames [R - C + 1, C]: frame t takes codebook c from row t + c."""
    if rows.dim() != 2:
        raise ValueError(f"rows must be [rows, num_codebooks], got shape {list(rows.shape)}")
    r, n = rows.shape
    if r < n:
        raise ValueError(f"need at least {n} delayed rows to revert, got {r}")
    return rows.reshape(-1)[_revert_index(r - n + 1, n, rows.device)].view(r - n + 1, n)  # one gather


@functools.lru_cache(maxsize=64)
def _revert_index(frames: int, n: int, device: torch.device) -> Tensor:
    """``revert_delay_pattern``'s gather index into the flattened rows (frame t, codebook c: element (t + c) * n +
    c), kept per shape: a stream reverts a block of a few frames per step per request, and building the index took
    as many small ops as the gather around it."""
    return (torch.arange(frames, device=device)[:, None] * n + torch.arange(n, device=device) * (n + 1)).view(-1)


@functools.lru_cache(maxsize=8)
def _codec_code_table(num_real_codes: int, device: torch.device) -> Tensor:
    """int64 [num_real_codes + 1]: code -> itself, and the last entry 0. Indexed by codes clamped to [0,
    num_real_codes], it maps BOC, EOC and anything else outside the codebook to 0 (negatives clamp to 0 itself)."""
    table = torch.arange(num_real_codes + 1, device=device)
    table[num_real_codes] = 0
    return table


def aligned_codes(rows: Tensor, num_real_codes: int) -> Tensor:
    """Delayed rows [R, C] -> aligned frames [R - C + 1, C] int64 with BOC/EOC/negatives mapped to 0: what the codec
    reads of each frame (SPEC 8.2), every frame kept (a stream's frames as they become final). Three small ops:
    a stream calls this for every block of every request."""
    frames = revert_delay_pattern(rows).clamp_(0, num_real_codes)
    return _codec_code_table(num_real_codes, rows.device)[frames]


def aligned_frames(rows: list[list[int]], start: int, stop: int, num_real_codes: int) -> Tensor:
    """``aligned_codes`` of delayed rows held as lists of C ints: frames ``[start, stop)`` -> [stop - start, C]
    int64, frame t's codebook c ``rows[t + c][c]`` (0 outside ``[0, num_real_codes)``). In plain Python: a stream
    takes a frame or a few a step per request, where the torch ops cost three times as much (13 against 4 us a
    frame on the CPU machine)."""
    n = len(rows[0]) if rows else 0
    frames = [[v if 0 <= (v := rows[t + c][c]) < num_real_codes else 0 for c in range(n)] for t in range(start, stop)]
    return torch.tensor(frames, dtype=torch.long).view(stop - start, n)


def codec_frames(rows: Tensor, num_real_codes: int) -> Tensor:
    """What the codec receives (SPEC 8.2): revert, map BOC/EOC/negatives to 0, drop the last frame.

    rows [R, C] delayed -> frames [F, C] int64. Fewer than C rows give no frames; with two or more frames
    the final one (the residual ramp frame) is dropped, as upstream's Stage-1 processor does.
    """
    n = rows.shape[1] if rows.dim() == 2 else 0
    if rows.dim() != 2 or rows.shape[0] < n:
        return torch.zeros(0, n, dtype=torch.long)
    frames = aligned_codes(rows, num_real_codes)
    return frames[:-1] if frames.shape[0] >= 2 else frames
