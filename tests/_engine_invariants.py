"""Shared by the reliability tests: their offered load, an engine back at idle, the delay pattern of published rows,
and the rows of prompts run through an engine."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from higgs_talker.api import HiggsTalker
from higgs_talker.engine import Engine

# an offered load of varied prompts (the engine reliability tests batch them; some end on EOC when sampled)
LOAD_TEXTS = [
    "Hello there.",
    "A somewhat longer sentence to make a longer prompt.",
    "Short.",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers: one two three four five six.",
    "Is this thing on?",
    "Another one.",
    "And the last one of the batch, a little longer than most.",
]


def engine_rows(talker: HiggsTalker, prompts: list, params) -> list[Tensor]:
    """Each prompt's rows [T, C] int64, all submitted at once (their prefills share a step), the engine stepped
    until idle; ``params``: one SamplingParams for all, or a list of one per prompt."""
    eng = talker.engine
    each = params if isinstance(params, list) else [params] * len(prompts)
    ids = [eng.add_request(p, q) for p, q in zip(prompts, each, strict=True)]
    while eng.has_unfinished():
        eng.step()
    return [torch.stack(eng.pop_finished(i).rows).long() for i in ids]


_IDLE: weakref.WeakKeyDictionary[Engine, tuple[int, frozenset[int]]] = weakref.WeakKeyDictionary()


def remember_idle(talker: HiggsTalker) -> HiggsTalker:
    """Record the free KV blocks and state rows of a talker's engine while it holds no request.

    Counted, not assumed: the engine may keep a scratch block or row for itself.
    """
    e, s = talker.engine, talker.engine.scheduler
    assert not s.requests and not s.waiting and not s.running, "remember_idle needs an idle engine"
    _IDLE[e] = (s.blocks.num_free, frozenset(s.free_slots._free))
    return talker


def assert_idle(talker: HiggsTalker) -> None:
    """No request is known, queued or running, and every KV block and decode-state slot is free again."""
    e, s = talker.engine, talker.engine.scheduler
    assert not s.requests, f"requests left behind: {list(s.requests)}"
    assert not s.waiting, f"requests left waiting: {[r.id for r in s.waiting]}"
    assert not s.running, f"requests left running: {[r.id for r in s.running]}"
    assert not s._unpublished and e._ahead is None, "a step was left unpublished"
    blocks, slots = _IDLE[e]
    assert s.blocks.num_free == blocks, f"KV blocks leaked: {s.blocks.num_free} free, {blocks} when idle"
    free = s.free_slots._free
    assert frozenset(free) == slots, f"slots leaked: {sorted(slots - frozenset(free))}"
    assert len(free) == len(slots), "a slot was freed twice"


def check_delay_pattern(
    rows: torch.Tensor, finish_reason: str | None, boc: int = 1024, eoc: int = 1025, num_real: int = 1024
) -> None:
    """Assert the delay pattern (SPEC 4.7) on a request's published rows [L, N] (a prefix when cut short).

    Row r, codebook c: BOC exactly when c > r (ramp-up, which continues through an early ramp-down); with
    ``s`` the single row where codebook 0 first emits EOC, EOC exactly at (s, 0) and at (s + j, c < j) for
    j = 1 .. N - 1; a real code in [0, num_real) everywhere else. A request that ended on EOC has exactly
    s + N rows (the last one is the terminal row); one cut short by max_frames / max_model_len / a
    cancellation has not yet reached the terminal row.
    """
    assert rows.dim() == 2, f"rows must be [L, N], got {list(rows.shape)}"
    length, n = rows.shape
    rows = rows.long()
    r = torch.arange(length)[:, None]
    c = torch.arange(n)[None, :]
    onsets = (rows[:, 0] == eoc).nonzero().flatten()
    s = int(onsets[0]) if onsets.numel() else None
    want_boc = c > r
    if s is None:
        want_eoc = torch.zeros_like(want_boc)
    else:
        j = r - s
        want_eoc = ((j == 0) & (c == 0)) | ((j > 0) & (c < j))
        assert not (want_boc & want_eoc).any()
    real = ~want_boc & ~want_eoc
    where = lambda m: [tuple(x) for x in m.nonzero().tolist()[:5]]  # noqa: E731
    assert (rows[want_boc] == boc).all(), f"ramp-up broken at (row, codebook) {where(want_boc & (rows != boc))}"
    assert (rows[want_eoc] == eoc).all(), f"ramp-down broken at {where(want_eoc & (rows != eoc))} (onset {s})"
    bad_real = real & ((rows < 0) | (rows >= num_real))
    assert not bad_real.any(), f"BOC/EOC/invalid code where a real code belongs: {where(bad_real)} (onset {s})"
    if finish_reason == "eoc":
        assert s is not None, "finished on EOC without an EOC onset"
        assert length == s + n, f"EOC onset at row {s}: expected {s + n} rows (terminal row done), got {length}"
    elif s is not None:
        assert length < s + n, f"rows continue past the terminal row (onset {s}, {length} rows, {finish_reason})"


# ---------------------------------------------------------------------------------------------------------
# batch-vs-solo divergence that floating point explains


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First row index where rows [La, N] and [Lb, N] differ within their common length (None: a prefix)."""
    m = min(len(a), len(b))
    diff = (a[:m] != b[:m]).any(dim=1).nonzero()
    return int(diff[0]) if diff.numel() else None


def explain_divergence(
    solo: HiggsTalker, prompt, params, rows: Tensor, alone: Tensor, rel_gap: float = 1e-4
) -> int | None:
    """Check that ``rows`` (run in a batch) leave ``alone`` (run solo) only through floating-point near ties.

    Matrix products on CPU (and GPU) round differently for one row than for several, so hidden states differ
    in the last bits between a batched and a solo run, and a sampled code can flip where the sampler's two
    best candidates are within that noise; after a flip the two runs go separate ways. So ``solo`` is
    teacher-forced on ``rows`` (fed them as its own codes, ``_reference_check.teacher_forced``) and every code
    of ``rows`` from the first difference on must score within ``rel_gap`` of solo's best (relative; absolute
    for scores below 1, as greedy logits may be near 0); rows before it must be identical. ``rows`` may stop
    early (a cancelled request). Returns the first differing row (None: no divergence).
    """
    from _reference_check import teacher_forced

    t = first_difference(rows, alone)
    if t is None:
        return None
    scores = teacher_forced(solo, prompt, params, rows, complete=False)["scores"]  # where it ends: check_delay_pattern
    for r in range(t, len(rows)):
        for c in range(rows.shape[1]):
            code = int(rows[r, c])
            best, took = scores[r, c].max().item(), scores[r, c, code].item()
            assert best - took <= rel_gap * max(abs(best), 1.0), (  # exact ties pass: which one wins is the kernel's
                f"row {r} codebook {c}: the batched run took code {code} ({took:.7g}), but the solo run fed the "
                f"same rows scores its best {best:.7g} (code {int(scores[r, c].argmax())}): not a near-tie flip"
            )
    return t
