"""Audio heads: the fused codebook table, the delay pattern (SPEC 4.5, 4.7, 8) and code sampling (SPEC 4.6)."""

from __future__ import annotations

import functools
import logging
import math
import re
import sys
import types

import numpy as np
import pytest
import torch
from _tolerance import assert_matmul_close, assert_within, chain_rel_tol, sum_bound, unit_roundoff

from higgs_talker.heads import fused as fused_kernels
from higgs_talker.heads import sampling
from higgs_talker.heads.codebooks import FusedCodebookEmbedding, FusedCodebookHead
from higgs_talker.heads.delay import (
    DelayState,
    aligned_frames,
    apply_delay_mask,
    apply_delay_pattern,
    codec_frames,
    forced_text_tokens,
    revert_delay_pattern,
    update_state,
)
from higgs_talker.heads.sampling import (
    TOP_K_CAP,
    SamplingParams,
    exponential_noise,
    race_scores,
    sample_codes,
    top_k_top_p_filter,
    uniform_from_bits,
)

N, V, BOC, EOC = 8, 1026, 1024, 1025
NEG = float("-inf")

# --------------------------------------------------------------------------------------------- fused table


def fused(n=N, v=V, h=16, seed=0, tied=True):
    g = torch.Generator().manual_seed(seed)
    emb = FusedCodebookEmbedding(n, v, h)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(n * v, h, generator=g))
    head = FusedCodebookHead(n, v, h, tied_to=emb if tied else None)
    if not tied:
        with torch.no_grad():
            head.weight.copy_(torch.randn(n * v, h, generator=g))
    return emb, head


def test_embedding_offsets_sum_one_row_per_codebook():
    emb, _ = fused(n=2, v=5, h=4)
    w = emb.weight.detach()
    out = emb(torch.tensor([1, 2]))
    torch.testing.assert_close(out, w[1] + w[5 + 2], rtol=0, atol=0)
    assert emb.weight.shape == (10, 4)


def test_embedding_shapes_and_independent_reference():
    emb, _ = fused()
    w = emb.weight.detach()
    assert w.shape == (N * V, 16)
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, V, (3, 5, N), generator=g)
    codes[0, 0] = BOC
    codes[0, 1] = EOC  # BOC and EOC are valid rows of every codebook
    out = emb(codes)
    assert out.shape == (3, 5, 16)
    ref = torch.zeros(3, 5, 16)
    rows = torch.zeros(3, 5, N, 16)  # the N terms of each sum
    for i in range(3):
        for j in range(5):
            for c in range(N):
                rows[i, j, c] = w[c * V + int(codes[i, j, c])]
                ref[i, j] += rows[i, j, c]  # summed in order, in fp32
    # two fp32 sums of the same N = 8 rows, in different orders: within 2 gamma_8 sum|rows| of each other
    assert_within(out, ref, sum_bound(rows, dim=2), "summed codebook rows")
    assert emb(codes[0, 0]).shape == (16,)


@pytest.mark.parametrize("bad", [V, V + 7, -1, -V])
@pytest.mark.parametrize("codebook", [0, N - 1])
def test_embedding_rejects_out_of_range_codes(bad, codebook):
    emb, _ = fused()
    codes = torch.zeros(2, N, dtype=torch.long)
    codes[1, codebook] = bad
    with pytest.raises(IndexError, match=str(bad)):
        emb(codes)


def test_embedding_rejects_wrong_codebook_count():
    emb, _ = fused()
    with pytest.raises(ValueError, match="codebooks"):
        emb(torch.zeros(2, N - 1, dtype=torch.long))


@pytest.mark.parametrize("tied", [True, False])
def test_head_logits(tied):
    emb, head = fused(tied=tied)
    hidden = torch.randn(4, 16)
    logits = head(hidden)
    assert logits.shape == (4, N, V)
    w = head.weight.detach()
    for c in (0, 3, N - 1):
        # a slice of the fused [4, N * V] product against the codebook's own product: K = 16, 2 gamma_16 |h||W|
        table = w[c * V : (c + 1) * V]
        assert_matmul_close(logits[:, c], hidden @ table.T, hidden, table)
    if tied:
        assert head.weight is emb.weight
        assert head.weight.data_ptr() == emb.weight.data_ptr()
        with torch.no_grad():
            emb.weight[5, 0] += 1.0  # a write through the embedding is visible to the head
        assert head.weight[5, 0] == emb.weight[5, 0]
    else:
        assert head.weight.data_ptr() != emb.weight.data_ptr()
        assert not torch.equal(head.weight, emb.weight)


# --------------------------------------------------------------------------------------------- delay pattern


def real_code(t: int, c: int) -> int:
    """The real code a hand-made logit vector prefers for codebook c at step t."""
    return (37 * t + 101 * c + 3) % 1024


def preference_logits(step: int, eoc_steps: list[int | None]) -> torch.Tensor:
    """[B, N, V] logits that tempt every mistake: BOC and EOC score above the preferred real code everywhere
    except codebook 0's EOC, which is only high at the row's chosen EOC step."""
    b = len(eoc_steps)
    logits = torch.zeros(b, N, V)
    logits[:, :, BOC] = 5.0
    logits[:, :, EOC] = 4.0
    logits[:, 0, EOC] = -1.0
    for i, s in enumerate(eoc_steps):
        for c in range(N):
            logits[i, c, real_code(step, c)] = 3.0
        if s is not None and step == s:
            logits[i, 0, EOC] = 10.0
    return logits


def expected_row(t: int, s: int | None) -> list[int]:
    """SPEC 4.7 row t of a stream whose codebook 0 picks EOC at step s (None: never), for any s >= 0.

    Column c is BOC before its start (t < c); codebook 0 is EOC from row s on; codebook c >= 1 keeps real
    codes through row s + c (it lags c steps) and is EOC after. For s >= 7 this is the upstream table; for
    s < 7 the codebooks that have not started stay BOC until their turn (we deliberately differ, item 7).
    """
    row = []
    for c in range(N):
        if t < c:
            row.append(BOC)
        elif s is not None and ((c == 0 and t >= s) or (c > 0 and t > s + c)):
            row.append(EOC)
        else:
            row.append(real_code(t, c))
    return row


def drive(eoc_steps: list[int | None], steps: int):
    """Run the mask -> greedy pick -> update loop; returns emitted rows [steps, B, N] and per-step done flags."""
    b = len(eoc_steps)
    state = DelayState.allocate(b, N, BOC)
    rows, dones, countdowns = [], [], []
    active = torch.ones(b, dtype=torch.bool)
    for t in range(steps):
        logits = apply_delay_mask(preference_logits(t, eoc_steps), state.delay, state.countdown, BOC, EOC)
        codes = logits.argmax(dim=-1)
        emitted, state = update_state(codes, state, active, BOC, EOC)
        rows.append(emitted)
        dones.append(state.done.clone())
        countdowns.append(state.countdown.clone())
    return torch.stack(rows), torch.stack(dones), torch.stack(countdowns)


def test_spec_row_table_normal_utterance():
    """s = 12: 7 ramp-up rows with BOC, EOC at step s on codebook 0, 7 ramp-down rows, terminal row done."""
    s = 12
    rows, dones, countdowns = drive([s], s + 8)
    rows = rows[:, 0].tolist()
    # ramp-up: row t has codebooks > t equal to BOC
    for t in range(7):
        assert rows[t][t + 1 :] == [BOC] * (N - t - 1)
        assert BOC not in rows[t][: t + 1] and EOC not in rows[t]
    for t in range(7, s):
        assert all(0 <= x < 1024 for x in rows[t]), t
    assert rows[s] == [EOC] + [real_code(s, c) for c in range(1, N)]
    assert countdowns[s, 0] == 7
    for j in range(1, 8):  # step s + j: EOC x j, then real codes
        assert rows[s + j][:j] == [EOC] * j
        assert all(0 <= x < 1024 for x in rows[s + j][j:])
        assert countdowns[s + j, 0] == (7 - j if j < 7 else -1)
    assert rows[s + 7] == [EOC] * 7 + [real_code(s + 7, 7)]
    assert dones[:, 0].tolist() == [False] * (s + 7) + [True]
    assert rows == [expected_row(t, s) for t in range(s + 8)]


@pytest.mark.parametrize("s", [0, 1, 3, 6, 7, 8, 20])
def test_delay_rows_for_any_eoc_step(s):
    rows, dones, _ = drive([s], s + 8)
    assert rows[:, 0].tolist() == [expected_row(t, s) for t in range(s + 8)]
    assert dones[:, 0].nonzero().flatten().tolist() == [s + 7]  # done exactly once: the terminal row, s + 8 rows
    # de-delayed, every codebook carries s real codes and then EOC (the trimmed residual frame)
    frames = revert_delay_pattern(rows[:, 0])
    assert frames.shape == (s + 1, N)
    assert (frames[:s] < 1024).all()
    assert frames[s, 0] == EOC and (frames[s, 1:] < 1024).all()


@pytest.mark.parametrize("s", [0, 3, 12])
def test_the_delay_state_through_an_utterance_and_at_its_terminal_row(s):
    """``delay`` counts the started codebooks after each row, 1 up to C-1 and never C; ``has_codes`` holds from the
    first row until the terminal row, which leaves the row as a fresh stream reads: delay 0, countdown -1, no
    codes (the vLLM adapter's active flag and the feedback mask read ``has_codes``)."""
    state, active = DelayState.allocate(1, N, BOC), torch.ones(1, dtype=torch.bool)
    delays, has_codes = [], []
    for t in range(s + 8):
        logits = apply_delay_mask(preference_logits(t, [s]), state.delay, state.countdown, BOC, EOC)
        _, state = update_state(logits.argmax(dim=-1), state, active, BOC, EOC)
        delays.append(int(state.delay[0]))
        has_codes.append(bool(state.has_codes[0]))
    assert delays == [min(t + 1, N - 1) for t in range(s + 7)] + [0]
    assert has_codes == [True] * (s + 7) + [False]
    assert (int(state.countdown[0]), bool(state.done[0])) == (-1, True)


def test_short_utterance_s0_hand_worked():
    """EOC at the very first (prefill) step: not-started codebooks stay BOC until their turn."""
    rows, dones, _ = drive([0], 8)
    r = rows[:, 0].tolist()
    assert r[0] == [EOC] + [BOC] * 7
    assert r[1] == [EOC, real_code(1, 1)] + [BOC] * 6
    assert r[3] == [EOC, EOC, EOC, real_code(3, 3)] + [BOC] * 4
    assert r[7] == [EOC] * 7 + [real_code(7, 7)]
    assert dones[:, 0].tolist() == [False] * 7 + [True]
    # one frame: codebook 0 is EOC, the rest real; a single frame is not trimmed, its EOC becomes 0
    assert codec_frames(rows[:, 0], 1024).tolist() == [[0] + [real_code(c, c) for c in range(1, N)]]


def test_short_utterance_s3_hand_worked():
    rows, _, _ = drive([3], 11)
    r = rows[:, 0].tolist()
    rc = real_code
    assert r[2] == [rc(2, 0), rc(2, 1), rc(2, 2)] + [BOC] * 5
    assert r[3] == [EOC, rc(3, 1), rc(3, 2), rc(3, 3)] + [BOC] * 4
    assert r[4] == [EOC, rc(4, 1), rc(4, 2), rc(4, 3), rc(4, 4)] + [BOC] * 3
    assert r[5] == [EOC, EOC, rc(5, 2), rc(5, 3), rc(5, 4), rc(5, 5)] + [BOC] * 2
    assert r[6] == [EOC, EOC, EOC, rc(6, 3), rc(6, 4), rc(6, 5), rc(6, 6), BOC]
    assert r[7] == [EOC] * 4 + [rc(7, c) for c in range(4, 8)]
    assert r[10] == [EOC] * 7 + [rc(10, 7)]
    assert codec_frames(rows[:, 0], 1024).shape == (3, N)


def test_rows_of_a_batch_are_independent():
    eoc_steps = [0, 3, 9, None]
    rows, dones, _ = drive(eoc_steps, 17)
    for i, s in enumerate(eoc_steps):
        alone, _, _ = drive([s], 17)
        end = 17 if s is None else s + 8
        assert torch.equal(rows[:end, i], alone[:end, 0])
        assert rows[:end, i].tolist() == [expected_row(t, s) for t in range(end)]


def test_delay_mask_rules():
    """SPEC 4.5 mask table on individual state rows."""
    delay = torch.tensor([2, 7, 7, 7])
    countdown = torch.tensor([-1, -1, 4, 7])
    logits = apply_delay_mask(torch.zeros(4, N, V), delay, countdown, BOC, EOC)
    finite = torch.isfinite(logits)
    # row 0: delay 2 -> codebooks 3..7 forced to BOC; 0..2 real codes, EOC on codebook 0 only
    for c in range(3, N):
        assert finite[0, c].nonzero().flatten().tolist() == [BOC]
    assert finite[0, 0, :1024].all() and finite[0, 0, EOC] and not finite[0, 0, BOC]
    for c in (1, 2):
        assert finite[0, c, :1024].all() and not finite[0, c, BOC] and not finite[0, c, EOC]
    # row 1: all started; only codebook 0 may emit EOC
    assert finite[1, 0, EOC] and not finite[1, 1:, EOC].any() and not finite[1, :, BOC].any()
    # row 2: ramp rem 4 -> codebooks 0..3 locked to EOC, 4..7 real codes only
    for c in range(4):
        assert finite[2, c].nonzero().flatten().tolist() == [EOC]
    assert finite[2, 4:, :1024].all() and not finite[2, 4:, 1024:].any()
    # row 3: ramp rem 7 -> only codebook 0 locked
    assert finite[3, 0].nonzero().flatten().tolist() == [EOC]
    assert finite[3, 1:, :1024].all() and not finite[3, 1:, 1024:].any()
    # kept entries keep their logits (the mask only writes -inf)
    x = torch.randn(4, N, V)
    y = apply_delay_mask(x.clone(), delay, countdown, BOC, EOC)
    keep = torch.isfinite(y)
    assert torch.equal(y[keep], x[keep])


def test_update_state_late_eoc_on_a_higher_codebook():
    """An EOC on codebook q > 0 of a normal row (only reachable without the mask) locks codebooks <= q."""
    state = DelayState.allocate(1, N, BOC)
    state.delay[:] = 7
    codes = torch.tensor([[5, 6, EOC, 7, 8, 9, 10, 11]])
    emitted, new = update_state(codes, state, torch.tensor([True]), BOC, EOC)
    assert emitted.tolist() == [[EOC, EOC, EOC, 7, 8, 9, 10, 11]]
    assert new.countdown.tolist() == [N - 2 - 1]


def test_update_state_inactive_rows_untouched():
    state = DelayState.allocate(2, N, BOC)
    state.delay[:] = torch.tensor([3, 5])
    codes = torch.arange(2 * N).view(2, N)
    emitted, new = update_state(codes, state, torch.tensor([True, False]), BOC, EOC)
    assert emitted[1].tolist() == [-1] * N
    assert new.delay.tolist() == [4, 5]
    assert new.last_codes[1].tolist() == [BOC] * N
    assert new.last_codes[0].tolist() == [0, 1, 2, 3] + [BOC] * 4
    assert new.has_codes.tolist() == [True, False]


def test_state_reset_gather_scatter_keep_storage():
    st = DelayState.allocate(4, N, BOC)
    ptrs = [st.last_codes.data_ptr(), st.delay.data_ptr(), st.done.data_ptr()]
    rows = torch.tensor([2, 0])
    g = st.gather(rows)
    g.delay[:] = torch.tensor([6, 1])
    g.done[:] = torch.tensor([True, False])
    st.scatter(rows, g)
    assert st.delay.tolist() == [1, 0, 6, 0] and st.done.tolist() == [False, False, True, False]
    st.reset(torch.tensor([2]), BOC)
    assert st.delay.tolist() == [1, 0, 0, 0] and not st.done.any() and st.countdown.tolist() == [-1] * 4
    assert [st.last_codes.data_ptr(), st.delay.data_ptr(), st.done.data_ptr()] == ptrs


def test_forced_text_tokens():
    assert forced_text_tokens(torch.tensor([False, True, False]), 7, 9).tolist() == [7, 9, 7]


@pytest.mark.parametrize("frames", [1, 2, 5, 30])
@pytest.mark.parametrize("n", [1, 4, 8])
def test_apply_revert_round_trip(frames, n):
    g = torch.Generator().manual_seed(frames * 10 + n)
    codes = torch.randint(0, 1024, (frames, n), generator=g)
    rows = apply_delay_pattern(codes, BOC, EOC)
    assert rows.shape == (frames + n - 1, n)
    for c in range(n):  # SPEC 3.2: BOC x c, then the codes, then EOC
        col = rows[:, c].tolist()
        assert col == [BOC] * c + codes[:, c].tolist() + [EOC] * (n - 1 - c)
    assert torch.equal(revert_delay_pattern(rows), codes)


def test_revert_delay_pattern_hand_example():
    rows = torch.tensor([[1, BOC, BOC], [2, 5, BOC], [3, 6, 9], [EOC, 7, 10], [EOC, EOC, 11]])
    assert revert_delay_pattern(rows).tolist() == [[1, 5, 9], [2, 6, 10], [3, 7, 11]]
    with pytest.raises(ValueError, match="at least 3"):
        revert_delay_pattern(rows[:2])
    with pytest.raises(ValueError, match="rows"):
        revert_delay_pattern(rows[0])


def reference_codec_frames(rows: list[list[int]], n: int) -> list[list[int]]:
    """SPEC 8.2 with plain lists: revert, replace >= 1024 or < 0 by 0, drop the last frame if >= 2 frames."""
    if len(rows) < n:
        return []
    frames = [[rows[t + c][c] for c in range(n)] for t in range(len(rows) - n + 1)]
    frames = [[0 if (x >= 1024 or x < 0) else x for x in f] for f in frames]
    return frames[:-1] if len(frames) >= 2 else frames


@pytest.mark.parametrize("num_rows", [0, 3, 7, 8, 9, 20])
def test_codec_frames_matches_reference(num_rows):
    g = torch.Generator().manual_seed(num_rows)
    rows = torch.randint(-5, 2000, (num_rows, N), generator=g)  # BOC/EOC, larger ids and negatives among them
    rows[rows.abs() % 7 == 0] = EOC
    got = codec_frames(rows, 1024)
    want = reference_codec_frames(rows.tolist(), N)
    assert got.dtype == torch.long and torch.equal(codec_frames(rows.int(), 1024), got)  # the engine's int32 rows
    assert got.shape == (len(want), N)
    assert got.tolist() == want
    assert ((got >= 0) & (got < 1024)).all()


@pytest.mark.parametrize("num_rows", [8, 9, 20])
def test_aligned_frames_of_lists_match_the_reference(num_rows):
    """``aligned_frames`` (rows as lists, a stream's blocks) = SPEC 8.2's frames before the last is dropped, for
    every block [start, stop) of a stream, the empty one included."""
    g = torch.Generator().manual_seed(num_rows)
    rows = torch.randint(-5, 2000, (num_rows, N), generator=g)
    rows[rows.abs() % 7 == 0], rows[rows.abs() % 7 == 1] = EOC, BOC
    lists = rows.tolist()
    want = [[0 if (x >= 1024 or x < 0) else x for x in f] for f in ([lists[t + c][c] for c in range(N)]
                                                                   for t in range(num_rows - N + 1))]  # fmt: skip
    for start in range(num_rows - N + 2):
        for stop in range(start, num_rows - N + 2):
            got = aligned_frames(lists, start, stop, 1024)
            assert got.dtype == torch.long and got.shape == (stop - start, N) and got.tolist() == want[start:stop]


def test_codec_frames_never_clamps_eoc_to_a_real_code():
    rows = apply_delay_pattern(torch.full((3, N), 1023), BOC, EOC)
    rows = torch.cat([rows, torch.full((1, N), EOC)])
    frames = codec_frames(rows, 1024)
    assert frames.tolist() == [[1023] * N] * 3  # 4 frames: last one dropped; EOC became 0, not 1023
    assert codec_frames(torch.full((N + 1, N), EOC), 1024).tolist() == [[0] * N]


def test_codec_frames_of_a_full_stream():
    """A generated stream of s + 8 rows gives exactly the s real frames per codebook."""
    s = 10
    rows, _, _ = drive([s], s + 8)
    frames = codec_frames(rows[:, 0], 1024)
    assert frames.shape == (s, N)
    assert frames.tolist() == [[real_code(t + c, c) for c in range(N)] for t in range(s)]


# --------------------------------------------------------------------------------------------- sampling


def sample(logits, temperature=1.0, top_k=None, top_p=1.0, seeds=0, steps=None):
    """sample_codes with per-row defaults; logits [B, N, V]."""
    b, _, v = logits.shape
    full = lambda x, dt: x if isinstance(x, torch.Tensor) else torch.full((b,), x, dtype=dt)  # noqa: E731
    return sample_codes(
        logits,
        full(temperature, torch.float32),
        full(v if top_k is None else top_k, torch.long),
        full(top_p, torch.float32),
        full(seeds, torch.long),
        torch.arange(b) if steps is None else full(steps, torch.long),
    )


def test_masked_entries_are_never_sampled():
    g = torch.Generator().manual_seed(0)
    b, v = 500, 32
    logits = torch.randn(b, N, v, generator=g) * 3
    banned = torch.rand(b, N, v, generator=g) < 0.7
    banned[..., 0] = False  # at least one allowed entry per row
    logits[banned] = NEG
    for temp, k, p in [(1.0, None, 1.0), (2.0, None, 1.0), (1.0, 5, 1.0), (1.0, None, 0.9), (0.7, 10, 0.5)]:
        codes = sample(logits, temp, k, p, seeds=torch.arange(b) * 7919)
        assert not banned.gather(2, codes[..., None]).any()


@pytest.mark.parametrize("temperature", [1e-3, 1e-20, 1e-37, 1e-40, 1e-45])
def test_tiny_temperature_never_samples_masked_codes(temperature):
    """Logits / a tiny temperature overflow to inf (softmax -> NaN); the result must still be the argmax."""
    g = torch.Generator().manual_seed(4)
    logits = torch.full((16, N, 64), NEG)
    allowed = torch.randint(1, 64, (16, N, 2), generator=g)
    logits.scatter_(2, allowed, torch.rand(16, N, 2, generator=g) * 100 - 50)
    codes = sample(logits, temperature=temperature, seeds=torch.arange(16))
    assert torch.isfinite(logits.gather(2, codes[..., None])).all()
    assert torch.equal(codes, logits.argmax(dim=-1))


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, N, 50, generator=g)
    want = logits.argmax(dim=-1)
    assert torch.equal(sample(logits, temperature=0.0), want)
    assert torch.equal(sample(logits, temperature=0.0, top_k=3, top_p=0.2, seeds=123), want)
    assert torch.equal(sample(logits, temperature=1.0, top_k=1), want)  # top_k = 1 is greedy too
    assert torch.equal(sample(logits, temperature=5.0, top_p=1e-6), want)  # so is a tiny nucleus
    mixed = torch.tensor([0.0, 1.0] * 32)
    out = sample(logits, temperature=mixed)
    assert torch.equal(out[0::2], want[0::2])


def reference_filter(row: list[float], k: int, p: float) -> list[bool]:
    """Which entries of one logit row survive top-k (ties at the k-th value kept), then top-p on the renormalised
    survivors (the smallest most-likely set whose mass reaches p; the most likely entry always stays)."""
    v = len(row)
    k = min(k, v) if k > 0 else v
    kth = sorted(row, reverse=True)[k - 1]
    keep = [x >= kth for x in row]
    mx = max(row)
    z = sum(math.exp(x - mx) for x, kept in zip(row, keep, strict=True) if kept)
    probs = [math.exp(x - mx) / z if kept else 0.0 for x, kept in zip(row, keep, strict=True)]
    order = sorted(range(v), key=lambda i: -probs[i])
    before, out = 0.0, [False] * v
    for i in order:
        if keep[i] and before < p:
            out[i] = True
        before += probs[i]
    return out


def test_top_k_top_p_filter_matches_reference():
    g = torch.Generator().manual_seed(2)
    m, v = 300, 40
    logits = torch.randn(m, v, generator=g) * 2
    top_k = torch.randint(1, v + 5, (m,), generator=g).clamp(max=v)
    top_k[::7] = v  # off
    top_p = torch.rand(m, generator=g) * 0.98 + 0.02
    top_p[::5] = 1.0
    out = top_k_top_p_filter(logits, top_k, top_p)
    assert out.shape == logits.shape
    kept = torch.isfinite(out)
    # The filter's fp32 "mass before" and this test's fp32 cumsum each sit within an fp32 softmax (a V-term sum;
    # the shift by the max, exp, division: relative errors up to a few u weighted by masses that sum to 1, 8 u
    # allowed) and a V-term prefix sum of the exact masses; closer to p than both errors together, either
    # answer is right.
    boundary = 2 * chain_rel_tol([v, v], 8, torch.float32)
    assert torch.equal(out[kept], logits[kept])  # survivors keep their logits
    checked = 0
    for i in range(m):
        row, k, p = logits[i].tolist(), int(top_k[i]), float(top_p[i])
        want = reference_filter(row, k, p)
        # skip rows whose nucleus boundary sits within float error of p (either answer is right there)
        topk_only = reference_filter(row, k, 1.0)
        probs = torch.softmax(torch.tensor([x if w else NEG for x, w in zip(row, topk_only, strict=True)]), 0)
        cum = probs.sort(descending=True).values.cumsum(0)
        if p < 1.0 and (cum - p).abs().min() < boundary:
            continue
        assert kept[i].tolist() == want, (i, k, p)
        checked += 1
    assert checked > 250


def test_top_k_keeps_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0]])
    out = top_k_top_p_filter(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out).tolist() == [[False, True, True, False, True, False]]


def test_noise_is_a_pure_function_of_seed_and_step():
    seeds = torch.tensor([0, 1, 2**40 + 3, 2**63 - 1, 12345])
    steps = torch.tensor([0, 5, 5, 100, 7])
    a = exponential_noise(seeds, steps, N, 30)
    assert a.shape == (5, N, 30) and (a > 0).all() and torch.isfinite(a).all()
    perm = torch.tensor([3, 0, 4, 1, 2])
    b = exponential_noise(seeds[perm], steps[perm], N, 30)
    assert torch.equal(b, a[perm])
    single = exponential_noise(seeds[2:3], steps[2:3], N, 30)
    assert torch.equal(single[0], a[2])
    # different seed or step -> different noise (also for seeds that differ only in their high 32 bits)
    assert not torch.equal(exponential_noise(torch.tensor([1]), torch.tensor([0]), N, 30)[0], a[0])
    assert not torch.equal(exponential_noise(torch.tensor([0]), torch.tensor([1]), N, 30)[0], a[0])
    hi = exponential_noise(torch.tensor([3, 2**32 + 3]), torch.tensor([9, 9]), N, 30)
    assert not torch.equal(hi[0], hi[1])


def _py_mix32(x: int) -> int:
    """The hash in Python integers (the definition: 32-bit xorshift-multiply finaliser)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _py_noise_word(seed: int, step: int, index: int) -> int:
    h = _py_mix32(seed & 0xFFFFFFFF)
    h = _py_mix32(h ^ (seed >> 32))
    h = _py_mix32(h ^ step)
    return _py_mix32(_py_mix32(h ^ _py_mix32(index + sampling.CODE_KEY)) ^ h)


def test_the_noise_words_equal_the_hash_in_python_integers():
    """The int32 hash (products that wrap, logical shifts by masking) gives the words of the definition, for seeds
    and steps at the edges of their 32-bit halves (sign bits set, all ones) and every code index of a real row."""
    seeds = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 3, 2**40 + 2**31, sampling.MAX_SEED]
    steps = [0, 1, 2**31 - 1, 2**16 + 5, 7, 2**30, 3, sampling.MAX_FRAMES]
    n = 8 * 1026
    got = sampling.noise_words(torch.tensor(seeds), torch.tensor(steps), n)
    assert got.dtype == torch.int64 and got.shape == (len(seeds), n)
    want = [[_py_noise_word(seed, step, i) for i in range(n)] for seed, step in zip(seeds, steps, strict=True)]
    assert got.tolist() == want


def test_noise_for_more_codes_than_the_hash_indexes_is_refused():
    too_many = 2**32 - sampling.CODE_KEY + 1
    with pytest.raises(ValueError, match=str(too_many)):
        sampling.noise_words(torch.tensor([0]), torch.tensor([0]), too_many)


class _StubKernels(types.ModuleType):
    """Stands in for ``heads.triton_kernels``: ``uniform_noise`` returns what ``make`` does."""

    def __init__(self, make) -> None:
        super().__init__("higgs_talker.heads.triton_kernels")
        self.make, self.calls = make, 0

    def uniform_noise(self, seeds, steps, n, code_key):
        self.calls += 1
        return self.make(seeds, steps, n)


def _reference_uniform(seeds, steps, n):
    return uniform_from_bits(sampling.noise_words(seeds, steps, n))


def _use_stub(monkeypatch, make) -> _StubKernels:
    """The kernels' path on CPU tensors, with stub kernels, from a fresh state."""
    stub = _StubKernels(make)
    monkeypatch.setitem(sys.modules, "higgs_talker.heads.triton_kernels", stub)
    monkeypatch.setattr(fused_kernels, "_on_kernel_device", lambda t: True)
    monkeypatch.setattr(fused_kernels, "stream_is_capturing", lambda: False)
    monkeypatch.setattr(fused_kernels, "_state", {})
    monkeypatch.setattr(fused_kernels, "_checked", {})
    return stub


NOISE_SEEDS, NOISE_STEPS = torch.tensor([0, 7, 2**63 - 1]), torch.tensor([0, 3, 2**31 - 2])


def test_a_kernel_is_used_once_it_matches_its_reference(monkeypatch, caplog):
    stub = _use_stub(monkeypatch, _reference_uniform)
    want = _reference_uniform(NOISE_SEEDS, NOISE_STEPS, N * 40)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, N * 40), want)
    assert stub.calls == 3 and fused_kernels.state("sampler noise") == "ok" and not caplog.records


@pytest.mark.parametrize(
    ("make", "warning"),
    [
        (lambda seeds, steps, n: _reference_uniform(seeds, steps, n).nextafter(torch.tensor(1.0)), "differs"),
        (lambda seeds, steps, n: 1 / 0, "ZeroDivisionError"),
    ],
    ids=["differs", "raises"],
)
def test_a_kernel_that_differs_or_fails_is_turned_off_with_one_warning(monkeypatch, caplog, make, warning):
    stub = _use_stub(monkeypatch, make)
    want = _reference_uniform(NOISE_SEEDS, NOISE_STEPS, N * 40)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, N * 40), want)
    assert stub.calls == 1 and fused_kernels.state("sampler noise") == "off"
    assert len(caplog.records) == 1 and warning in caplog.records[0].getMessage()


def test_a_comparison_that_fails_is_not_the_kernels_fault(monkeypatch):
    """What fails while a first-use check waits for the device (a synchronizing call where none is allowed, an
    earlier step's fault) propagates to the step; the kernel is not turned off for the rest of the process."""
    stub = _use_stub(monkeypatch, _reference_uniform)

    def waits(a, b):
        raise RuntimeError("called a synchronizing CUDA operation")

    monkeypatch.setattr(fused_kernels, "same_values", waits)
    with pytest.raises(RuntimeError, match="synchronizing"):
        sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, 30)
    assert stub.calls == 1 and fused_kernels.state("sampler noise") == "untried"
    monkeypatch.undo()
    stub = _use_stub(monkeypatch, _reference_uniform)
    assert torch.equal(
        sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, 30), _reference_uniform(NOISE_SEEDS, NOISE_STEPS, 30)
    )
    assert fused_kernels.state("sampler noise") == "ok"


def test_a_kernel_is_not_tried_inside_a_capture_or_when_switched_off(monkeypatch):
    stub = _use_stub(monkeypatch, _reference_uniform)
    monkeypatch.setattr(fused_kernels, "stream_is_capturing", lambda: True)
    want = _reference_uniform(NOISE_SEEDS, NOISE_STEPS, 30)
    assert torch.equal(sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, 30), want)
    assert stub.calls == 0 and fused_kernels.state("sampler noise") == "untried"  # checked later, outside a capture
    monkeypatch.setattr(fused_kernels, "stream_is_capturing", lambda: False)
    monkeypatch.setattr(fused_kernels, "ENABLED", False)
    assert torch.equal(sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, 30), want) and stub.calls == 0


def test_cpu_tensors_never_try_the_kernels(monkeypatch):
    monkeypatch.setattr(fused_kernels, "_state", {})
    monkeypatch.setattr(fused_kernels, "_checked", {})
    sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, 30)
    assert fused_kernels.state("sampler noise") == "untried"


def test_each_call_signature_is_checked_before_its_kernel_is_used(monkeypatch, caplog):
    """Triton compiles a variant per signature (dtypes, shapes, strides, alignment): a kernel checked on one
    signature is not trusted on another until that one matched too; inside a capture an unchecked signature keeps
    the reference, and a signature that differs turns the kernel off."""
    stub = _use_stub(monkeypatch, lambda seeds, steps, n: _reference_uniform(seeds, steps, n) if n < 100 else 1 / 0)
    for n in (30, 30, 40):
        want = _reference_uniform(NOISE_SEEDS, NOISE_STEPS, n)
        assert torch.equal(sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, n), want)
    assert stub.calls == 3 and len(fused_kernels._checked["sampler noise"]) == 2  # n=30 checked once, then used
    monkeypatch.setattr(fused_kernels, "stream_is_capturing", lambda: True)
    sampling.uniform_noise(NOISE_SEEDS[:2], NOISE_STEPS[:2], 30)  # a new shape inside a capture: the reference
    sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, 30)  # a checked one: the kernel
    assert stub.calls == 4
    monkeypatch.setattr(fused_kernels, "stream_is_capturing", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, 200),
                           _reference_uniform(NOISE_SEEDS, NOISE_STEPS, 200))  # fmt: skip
        sampling.uniform_noise(NOISE_SEEDS, NOISE_STEPS, 30)
    assert fused_kernels.state("sampler noise") == "off" and stub.calls == 5 and len(caplog.records) == 1


def test_logits_the_mask_kernel_cannot_take_go_to_the_reference(monkeypatch):
    """Logits with a strided code axis, rows that overlap, or an unsupported dtype never reach the mask kernel
    (not even for its check)."""
    from higgs_talker.heads import slots

    stub = _use_stub(monkeypatch, _reference_uniform)
    stub.delay_mask = lambda *a: (_ for _ in ()).throw(AssertionError("the kernel was called"))
    state = DelayState.allocate(2, N, BOC)
    base = torch.randn(2, 40, N, generator=torch.Generator().manual_seed(2))
    row = torch.randn(1, 1, 40, generator=torch.Generator().manual_seed(3))
    cases = {
        "strided codes": base.transpose(1, 2),  # [2, N, 40], stride 40 along the codes
        "overlapping rows": row.expand(2, N, 40),  # stride 0: every row is the same memory
        "half-overlapping rows": base.reshape(-1)[: 2 * N * 20 + 20].as_strided((2, N, 40), (N * 20, 20, 1)),
        "integer logits": (base.transpose(1, 2) * 100).to(torch.int32).contiguous(),
    }
    for what, logits in cases.items():
        assert not fused_kernels.delay_mask_supports(logits), what
    logits = cases["strided codes"]  # the one a caller can mask in place (overlapping rows have no one answer)
    want = apply_delay_mask(logits.clone(), state.delay, state.countdown, BOC - 1000, EOC - 1000)
    slots.masked_logits(logits, state, BOC - 1000, EOC - 1000, torch.ones(2, dtype=torch.bool))
    assert torch.equal(logits, want)
    assert fused_kernels.state("delay mask") == "untried"
    assert fused_kernels.delay_mask_supports(base.transpose(1, 2).contiguous())
    assert fused_kernels.delay_mask_supports(base.transpose(1, 2).contiguous()[:, :, :30])  # a slice: rows apart


def test_same_values_matches_nan_with_nan_and_nothing_else():
    a = torch.tensor([1.0, float("nan"), float("-inf")])
    assert fused_kernels.same_values(a, a.clone())
    assert not fused_kernels.same_values(a, torch.tensor([1.0, 0.0, float("-inf")]))
    assert not fused_kernels.same_values(a, a.double()) and not fused_kernels.same_values(a, a[:2])


def test_seeded_codes_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, N, 64, generator=g)
    logits[5] = logits[0]
    temp = torch.tensor([1.0, 0.8, 1.3, 1.0, 0.0, 1.0])
    k = torch.tensor([64, 10, 64, 3, 64, 64])
    p = torch.tensor([1.0, 1.0, 0.8, 1.0, 1.0, 1.0])
    seeds = torch.tensor([11, 22, 33, 44, 55, 11])
    steps = torch.tensor([0, 3, 3, 9, 1, 0])
    full = sample_codes(logits, temp, k, p, seeds, steps)
    for idx in ([0], [5, 2], [4, 3, 1], [2, 0, 5, 1]):
        i = torch.tensor(idx)
        part = sample_codes(logits[i], temp[i], k[i], p[i], seeds[i], steps[i])
        assert torch.equal(part, full[i])
    assert torch.equal(full[0], full[5])  # same logits row, seed and step -> same codes
    # the same request at another step, or with another seed, draws differently somewhere
    other = sample_codes(logits[:1].repeat(20, 1, 1), temp[:1].repeat(20), k[:1].repeat(20), p[:1].repeat(20),
                         torch.arange(20), torch.zeros(20, dtype=torch.long))  # fmt: skip
    assert len({tuple(r) for r in other.tolist()}) > 1


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "temperature, top_k",
    [(1.0, None), (0.5, None), (1.0, 3)],
    ids=["t1", "t0.5", "top3"],
)
def test_sampled_distribution_matches_softmax(temperature, top_k):
    logits_row = torch.tensor([0.5, -1.0, 1.5, 0.0, -0.3, 1.0])
    v = logits_row.numel()
    draws = 4000
    logits = logits_row.repeat(draws, N, 1)
    codes = sample(logits, temperature, top_k, seeds=torch.full((draws,), 99), steps=torch.arange(draws))
    want = torch.softmax(logits_row / temperature, 0)
    if top_k is not None:
        keep = logits_row >= logits_row.topk(top_k).values[-1]
        want = torch.softmax((logits_row / temperature).masked_fill(~keep, NEG), 0)
        assert (codes[..., None] == torch.nonzero(~keep).flatten()).sum() == 0
        want, idx = want[keep], torch.nonzero(keep).flatten()
        counts = torch.stack([(codes == i).sum() for i in idx]).float()
    else:
        counts = torch.bincount(codes.flatten(), minlength=v).float()
    # 32000 draws; the 99.99th percentile of chi-square with <= 5 degrees of freedom is about 25.7
    assert chi_square(counts, want) < 26.0, (counts / counts.sum(), want)
    # the 8 codebooks of a frame are drawn independently: they agree with probability sum(p^2)
    agree = (codes[:, 0] == codes[:, 1]).float().mean()
    assert abs(float(agree) - float((want**2).sum())) < 0.03


def test_uniform_from_bits_stays_inside_the_open_interval():
    """Every 32-bit word maps into (0, 1), so every noise value is finite and > 0 (the extremes included)."""
    words = torch.tensor([0, 1, 2**9 - 1, 2**9, 2**31, 2**32 - 2**9, 2**32 - 2**8, 2**32 - 2, 2**32 - 1])
    u = uniform_from_bits(words)
    assert u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all(), u.tolist()
    assert u.max().item() == 1 - 2**-24 and u.min().item() == 2**-24
    noise = -torch.log(u)
    assert torch.isfinite(noise).all() and (noise > 0).all()


# (seed, step, codebook, code) whose hash word has all top 24 bits set: the old 24-bit mapping rounded its
# uniform to exactly 1.0, its noise to -0.0, and the race returned that code even where it was masked.
EXTREME_WORDS = [(0, 789, 0, 862), (7, 108, 0, 656), (7, 2014, 6, 857), (0, 1993, 4, 664)]


@pytest.mark.parametrize("seed, step, codebook, code", EXTREME_WORDS)
def test_extreme_hash_word_never_samples_a_masked_code(seed, step, codebook, code):
    noise = exponential_noise(torch.tensor([seed]), torch.tensor([step]), N, V)[0]
    assert noise[codebook, code] == noise.min()  # the smallest noise value of the whole frame: the u -> 1 end
    # -log(1 - 2**-24) = 2**-24 (1 + 2**-25 + ...) rounds to 2**-24; a log accurate to 1 ulp lands within 2u
    assert abs(noise[codebook, code].item() / 2**-24 - 1) <= 2 * unit_roundoff(torch.float32)
    logits = torch.full((1, N, V), NEG)
    logits[..., BOC] = 0.0  # only BOC allowed (a not-yet-started codebook), as the delay mask does
    logits[0, :, code + 1] = 3.0  # ... and one more real code, not the extreme one
    for temperature, top_k, top_p in [(1.0, None, 1.0), (0.8, 50, 1.0), (1.3, None, 0.95)]:
        codes = sample(logits, temperature, top_k, top_p, seeds=seed, steps=step)
        assert torch.isin(codes, torch.tensor([BOC, code + 1])).all(), codes.tolist()


@pytest.mark.parametrize("value", [0.0, float("inf"), float("nan"), -1.0])
def test_masked_codes_lose_whatever_the_noise(monkeypatch, value):
    """The invariant is structural: masked or filtered codes score -inf, whatever the noise tensor holds."""
    import higgs_talker.heads.sampling as sampling

    monkeypatch.setattr(sampling, "exponential_noise", lambda seeds, steps, n, v: torch.full((len(seeds), n, v), value))
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(64, N, 40, generator=g)
    banned = torch.rand(64, N, 40, generator=g) < 0.9
    banned[..., 7] = False
    logits[banned] = NEG
    for top_k, top_p in [(None, 1.0), (3, 1.0), (None, 0.5)]:
        codes = sample(logits, 1.0, top_k, top_p)
        assert not banned.gather(2, codes[..., None]).any()
        kept = torch.isfinite(top_k_top_p_filter(logits.view(-1, 40), torch.full((64 * N,), top_k or 40),
                                                 torch.full((64 * N,), top_p))).view(64, N, 40)  # fmt: skip
        assert kept.gather(2, codes[..., None]).all()


def test_a_million_draws_from_an_almost_fully_masked_distribution():
    """10^6 draws (125,000 rows x 8 codebooks), two allowed codes out of 16 each: no draw outside the allowed
    pair, and the frequencies match the softmax of the pair (temperature, top-k and top-p on)."""
    rows, v = 125_000, 16
    g = torch.Generator().manual_seed(5)
    first = torch.randint(0, v, (rows, N, 1), generator=g)
    second = (first + torch.randint(1, v, (rows, N, 1), generator=g)) % v
    logits = torch.full((rows, N, v), NEG)
    logits.scatter_(2, first, 0.0)
    logits.scatter_(2, second, 1.0)
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0])[torch.arange(rows) % 4]
    top_k = torch.tensor([v, v, 5, 2])[torch.arange(rows) % 4]
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.99])[torch.arange(rows) % 4]
    codes = torch.cat(
        [
            sample(logits[i : i + 25_000], temperature[i : i + 25_000], top_k[i : i + 25_000],
                   top_p[i : i + 25_000], seeds=torch.arange(i, i + 25_000) * 31 + 1, steps=torch.arange(25_000))
            for i in range(0, rows, 25_000)
        ]
    )  # fmt: skip
    picked_second = codes[..., None] == second
    assert (picked_second | (codes[..., None] == first)).all(), "a draw left the allowed pair"
    for phase, t in enumerate([1.0, 0.5, 2.0, 1.0]):
        hits = picked_second[phase::4].float()
        p = 1 / (1 + math.exp(-1.0 / t))  # P(second) under softmax([0, 1] / t)
        n = hits.numel()
        # a binomial proportion: 6 standard deviations is a 2e-9 two-sided tail
        assert abs(hits.mean().item() - p) <= 6 * math.sqrt(p * (1 - p) / n), (t, hits.mean().item(), p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_top_p_equals_greedy_exactly_even_with_ties(dtype):
    """A nucleus so small that only the top code survives is greedy: the same code as argmax, ties included
    (bf16 logits tie often; the stable sort keeps the lowest index, as argmax does)."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(256, N, V, generator=g) * 2).to(dtype).float()
    logits[:, :, 100] = logits.amax(dim=-1)  # exact ties at the top: argmax picks the lower index
    logits[:, :, BOC] = NEG
    want = logits.argmax(dim=-1)
    for temperature in (1.0, 0.7, 3.0):
        got = sample(logits, temperature, top_p=1e-9, seeds=torch.arange(256) * 13)
        assert torch.equal(got, want)


def test_race_scores_are_what_the_sampler_takes_the_argmax_of():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(16, N, 30, generator=g)
    logits[..., :4] = NEG
    temp, k, p = torch.rand(16) + 0.2, torch.randint(1, 31, (16,)), torch.rand(16) * 0.9 + 0.1
    temp[::3] = 0.0
    seeds, steps = torch.arange(16) * 5, torch.arange(16)
    scores = race_scores(logits, temp, k, p, seeds, steps)
    assert torch.equal(scores.argmax(dim=-1), sample_codes(logits, temp, k, p, seeds, steps))
    assert torch.equal(scores[::3], logits[::3])  # greedy rows score their masked logits


def test_sampling_is_deterministic_per_seed_and_varies_across_seeds():
    logits = torch.zeros(200, N, 16)
    a = sample(logits, seeds=5)
    assert torch.equal(a, sample(logits, seeds=5))
    b = sample(logits, seeds=6)
    assert (a != b).float().mean() > 0.8  # uniform over 16 codes: mostly different


# --------------------------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_frames": 0}, "max_frames"),
        ({"max_frames": -3}, "max_frames"),
        ({"max_frames": 10.0}, "max_frames"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "42"}, "seed"),
        ({"seed": np.float64(3.0)}, "seed"),
        ({"top_k": np.bool_(True)}, "top_k"),
        ({"temperature": np.bool_(True)}, "temperature"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # the engine keeps temperature in float32: 1e308 used to overflow there, at step(), without a name
        ({"temperature": 1e308}, "temperature must be a finite number in [0, 3.40282e+38]"),
        ({"temperature": np.float64(1e39)}, "got np.float64(1e+39)"),
        # float32 would round this one down to its max; everything above the max is refused, not rounded
        ({"temperature": math.nextafter(torch.finfo(torch.float32).max, math.inf)}, "temperature"),
        ({"max_frames": 2**31}, f"max_frames must be at most {2**31 - 1} (2**31 - 1), got {2**31}"),
        ({"max_frames": 10**20}, "got 100000000000000000000"),
        ({"min_frames": 2**31}, f"min_frames must be an integer in [0, {2**31 - 1}], got {2**31}"),
    ],
)
def test_sampling_params_refuse_what_the_engine_cannot_store(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_sampling_params_accept_numpy_scalars_as_python_numbers():
    got = SamplingParams(
        temperature=np.float32(0.5),
        top_k=np.int64(50),
        top_p=np.float16(0.75),
        seed=np.uint64(2**63 - 1),
        max_frames=np.int32(100),
        min_frames=np.int8(3),
    )
    assert got == SamplingParams(temperature=0.5, top_k=50, top_p=0.75, seed=2**63 - 1, max_frames=100, min_frames=3)
    for name in ("temperature", "top_p"):
        assert type(getattr(got, name)) is float, name
    for name in ("top_k", "seed", "max_frames", "min_frames"):
        assert type(getattr(got, name)) is int, name
    assert type(SamplingParams(temperature=1).temperature) is float  # a Python int is normalised too


def test_sampling_params_edges_the_engine_can_store():
    fp32_max = torch.finfo(torch.float32).max
    assert SamplingParams(temperature=fp32_max).temperature == fp32_max
    assert SamplingParams(max_frames=2**31 - 1, min_frames=2**31 - 1).min_frames == 2**31 - 1
    # any top_k >= codebook size means "off"; a huge one is held at the documented cap, which int64 stores
    assert SamplingParams(top_k=10**20).top_k == TOP_K_CAP == 2**31 - 1
    assert SamplingParams(top_k=TOP_K_CAP - 1).top_k == TOP_K_CAP - 1
    torch.full((2,), SamplingParams(top_k=10**20).top_k, dtype=torch.long)  # what the engine does with it


def test_sampling_params_valid_edges():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    SamplingParams(top_p=1.0, top_k=-1, seed=0, max_frames=1)
    SamplingParams(top_p=1e-9, top_k=0, seed=2**63 - 1)
    assert SamplingParams(seed=17).resolved_seed() == 17
    # no seed pinned by default: unseeded requests get fresh seeds
    assert len({SamplingParams().resolved_seed() for _ in range(8)}) > 1


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_host_known_sampling_shortcuts_change_nothing(temperature):
    """draw=False (all greedy) and filter=False (top-k/top-p off) must give exactly the full path's codes."""
    from higgs_talker.heads.sampling import sample_codes

    g = torch.Generator().manual_seed(11)
    b, n, v = 6, 8, 1026
    logits = torch.randn(b, n, v, generator=g) * 3
    logits[:, 1:, 1024:] = float("-inf")  # some masked entries, as the delay mask leaves them
    temp = torch.full((b,), temperature)
    top_k, top_p = torch.full((b,), v), torch.ones(b)
    seeds, steps = torch.arange(b) * 1000 + 7, torch.arange(b) + 3
    full = sample_codes(logits, temp, top_k, top_p, seeds, steps)
    assert torch.equal(sample_codes(logits, temp, top_k, top_p, seeds, steps, filter=False), full)
    if temperature == 0:
        assert torch.equal(sample_codes(logits, temp, top_k, top_p, seeds, steps, draw=False), full)


def test_slot_state_exports_and_loads_into_another_slot():
    """A slot's whole decode state survives export/load (the vLLM bridge parks a preempted request this way)."""
    from higgs_talker.heads.slots import SlotInit, SlotStore, sample_frame

    store = SlotStore(4, N, V, BOC, EOC, torch.device("cpu"))
    store.reset([SlotInit(1, seed=9, temperature=0.7, top_k=20, top_p=0.9, min_rows=3)])
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        sample_frame(store, torch.tensor([1]), torch.randn(1, N, V, generator=g))
    saved = store.export(1)
    store.reset([SlotInit(1, seed=0)])  # the slot is reused meanwhile
    store.load(3, saved)
    again = store.export(3)
    assert saved.keys() == again.keys()
    for key in saved:
        assert torch.equal(saved[key], again[key]), key
    assert int(store.num_rows[3]) == 5 and int(store.seeds[3]) == 9 and int(store.min_rows[3]) == 3


def test_a_stream_that_starts_over_in_a_used_slot_samples_as_in_a_new_one():
    """``fresh``: the slot's row count restarts with its state, so the stream's first frame has the noise of step 0
    and counts as one row (a stream that starts over in a vLLM slot that already produced rows)."""
    from higgs_talker.heads.slots import SlotInit, SlotStore, sample_frame

    store = SlotStore(4, N, V, BOC, EOC, torch.device("cpu"))
    store.reset([SlotInit(1, seed=9, temperature=1.0), SlotInit(2, seed=9, temperature=1.0)])
    g = torch.Generator().manual_seed(4)
    for _ in range(5):  # slot 1 has produced rows; slot 2 is new
        sample_frame(store, torch.tensor([1]), torch.randn(1, N, V, generator=g))
    logits = torch.randn(1, N, V, generator=g)
    reused, _ = sample_frame(store, torch.tensor([1]), logits.clone(), fresh=torch.tensor([True]))
    new, _ = sample_frame(store, torch.tensor([2]), logits.clone(), fresh=torch.tensor([True]))
    assert torch.equal(reused, new)
    assert int(store.num_rows[1]) == int(store.num_rows[2]) == 1


def test_seeds_fold_into_range_and_unseeded_draws_follow_the_generator():
    import random

    from higgs_talker.heads.sampling import MAX_SEED, resolve_seed

    assert resolve_seed(17) == 17 and resolve_seed(MAX_SEED + 5) == 4 and resolve_seed(-1) == MAX_SEED
    a, b = random.Random(3), random.Random(3)
    assert [resolve_seed(None, a) for _ in range(3)] == [resolve_seed(None, b) for _ in range(3)]
    assert len({resolve_seed(None) for _ in range(8)}) > 1


def test_row_params_fill_the_front_ends_conventions_and_keep_tiny_temperatures():
    from higgs_talker.heads.sampling import is_greedy, row_params

    t, k, p = row_params(3, torch.device("cpu"), None, None, None)
    assert torch.equal(t, torch.zeros(3)) and torch.equal(k, torch.zeros(3, dtype=torch.long))
    assert torch.equal(p, torch.ones(3))
    temp = torch.tensor([1e-6, 0.0, float("nan"), 0.5])
    t, k, p = row_params(
        4, torch.device("cpu"), temp, torch.tensor([-1, 0, 5, 2000]), torch.tensor([0.0, 1.5, 0.3, 1.0])
    )
    assert t.tolist() == [pytest.approx(1e-6), 0.0, 1.0, 0.5] and k.tolist() == [-1, 0, 5, 2000]
    assert p.tolist() == [1.0, 1.0, pytest.approx(0.3), 1.0]
    assert is_greedy(t).tolist() == [False, True, False, False]  # 1e-6 samples: no threshold but 0


def test_rows_at_places_rows_by_position_in_any_span():
    from higgs_talker.heads.codebooks import rows_at

    codes = torch.arange(12).view(4, 3)
    where = torch.tensor([9, 2, 5, 3])  # unsorted: row r belongs at position where[r]
    tok, got = rows_at(torch.arange(3, 8), where, codes)  # a chunk covering positions 3..7
    assert tok.tolist() == [0, 2] and got.tolist() == [codes[3].tolist(), codes[2].tolist()]
    tok, got = rows_at(torch.arange(10, 12), where, codes)
    assert tok.numel() == 0 and got.shape == (0, 3)
    tok, got = rows_at(torch.arange(4), torch.zeros(0, dtype=torch.long), codes[:0])
    assert tok.numel() == 0 and got.shape == (0, 3)


def test_feed_back_and_embed_rows_replace_only_their_tokens():
    from higgs_talker.heads.codebooks import FusedCodebookEmbedding, embed_rows, feed_back

    emb = FusedCodebookEmbedding(N, V, 16)
    torch.nn.init.normal_(emb.weight)
    embeds = torch.randn(5, 16)
    codes = torch.randint(0, V, (5, N))
    use = torch.tensor([True, False, False, True, False])
    out = feed_back(embeds, use, codes, emb)
    assert torch.equal(out[~use], embeds[~use]) and torch.allclose(out[use], emb(codes[use]))
    out = embed_rows(embeds, torch.tensor([4, 1]), codes[:2], emb)
    assert torch.allclose(out[4], emb(codes[0])) and torch.allclose(out[1], emb(codes[1]))
    assert torch.equal(out[[0, 2, 3]], embeds[[0, 2, 3]])
    assert embed_rows(embeds, torch.zeros(0, dtype=torch.long), codes[:0], emb) is embeds


def test_request_slots_follow_ids_and_resume_a_kept_state():
    """Slots keyed by request id keep their state through reorders; a request released with ``keep`` comes back
    (``resume``) with its decode state, seed position and rows, in whatever slot is free."""
    from higgs_talker.heads.slots import RequestSlots, SlotStore, sample_frame

    slots = RequestSlots(SlotStore(4, N, V, BOC, EOC, torch.device("cpu")), keep_finished=8, seed=1)
    s, new = slots.sync(["a", "b"], seeds={0: 7})
    assert new == [0, 1] and slots.requests["a"].seed == 7
    slots.seed_pos[s] = torch.tensor([4, 9])
    sample_frame(slots.store, s, torch.randn(2, N, V))
    slots.record(["a", "b"], torch.cat([torch.ones(2, N), torch.ones(2, 3)], 1).int())
    assert slots.sync(["b", "a"])[0].tolist() == s.flip(0).tolist() and slots.sync(["b", "a"])[1] == []
    before = slots.store.export(slots.requests["a"].slot)
    slots.release(["a"], keep=True)
    slots.sync(["b", "c"])  # "c" takes the freed slot
    s2, new = slots.sync(["b", "c", "a"], resume={"a"})
    assert new == [] and len(slots.requests["a"].rows) == 1 and int(slots.seed_pos[s2[2]]) == 4
    after = slots.store.export(slots.requests["a"].slot)
    assert all(torch.equal(before[k], after[k]) for k in before)
    slots.release(["b", "c", "a"])
    assert slots.free.num_free == 4 and slots.requests == {}


def _results(codes: list[int], valid: list[int]) -> torch.Tensor:
    """One step's results as ``RequestSlots.record`` reads them: per request a row of ``codes[i]``, then its valid,
    active and done flags."""
    rows = torch.tensor(codes)[:, None].expand(-1, N)
    flags = torch.tensor([[v, 1, 0] for v in valid])
    return torch.cat([rows, flags], 1).int()


def test_request_slots_record_a_step_when_settled_and_ship_each_row_once():
    """A step's results wait on the way to the host (``record_later``) until something reads the host records:
    rows, the modes, a kept release. ``ship`` hands each request the rows it produced since its last ship; a
    request released while its step is on the way loses that step's rows, and a new request that takes its id
    does not get them."""
    from higgs_talker.heads.slots import RequestSlots, SlotStore

    slots = RequestSlots(SlotStore(4, N, V, BOC, EOC, torch.device("cpu")), seed=1)
    slots.sync(["a", "b"])
    slots.record_later(["a", "b"], _results([1, 2], [1, 1]))
    assert slots.requests["a"].rows == [] and not slots.requests["b"].active  # on its way
    assert slots.all_forced(["b"]) and len(slots.requests["a"].rows) == 1  # reading the modes settled it
    slots.record_later(["a", "b"], _results([3, 4], [1, 0]))
    slots.record_later(["a", "b"], _results([5, 6], [0, 1]))  # settles the one before
    assert [r[0, 0].item() for r in slots.requests["a"].rows] == [1, 3]
    shipped = slots.ship(["b", "a", "x", None])
    assert [r[:, 0].tolist() for r in shipped[:2]] == [[2, 6], [1, 3]] and shipped[2:] == [None, None]
    assert slots.ship(["a", "b"]) == [None, None]  # nothing new since
    slots.record_later(["a", "b"], _results([7, 8], [1, 1]))
    slots.release(["a"])
    slots.sync(["a", "b"])  # a new request under a finished one's id
    assert slots.ship(["a", "b"])[0] is None and slots.rows_for("a").shape == (0, N)
    assert slots.rows_for("b")[:, 0].tolist() == [2, 6, 8]
    kept = RequestSlots(SlotStore(4, N, V, BOC, EOC, torch.device("cpu")), keep_finished=4, seed=1)
    kept.sync(["k"])
    kept.record_later(["k"], _results([9], [1]))
    kept.release(["k"], keep=True)
    assert kept.rows_for("k")[:, 0].tolist() == [9]


def test_rows_by_key_and_merge_rows_across_ranks_and_engines():
    """Workers answer ``rows_by_key`` with lists; ``merge_rows`` takes each request's rows from the one engine that
    holds them, and raises for rows on two engines or tensor-parallel ranks that disagree."""
    from higgs_talker.heads.slots import RequestSlots, SlotStore, merge_rows

    slots = RequestSlots(SlotStore(2, N, V, BOC, EOC, torch.device("cpu")), seed=0)
    slots.sync(["a"])
    slots.requests["a"].rows = [torch.full((1, N), 3, dtype=torch.int32)]
    assert slots.rows_by_key(["a", "z"]) == {"a": [[3] * N], "z": None}
    got = merge_rows([[{"a": [[1] * N], "b": None}] * 2, [{"a": None, "b": [[2] * N, [3] * N]}]], ["a", "b"])
    assert got["a"].tolist() == [[1] * N] and got["b"].tolist() == [[2] * N, [3] * N]
    assert got["b"].dtype == torch.int32 and merge_rows([[{"a": None}]], ["a"]) == {"a": None}
    with pytest.raises(RuntimeError, match="request 'a' has rows on data-parallel engine 1"):
        merge_rows([[{"a": [[1] * N]}], [{"a": [[1] * N]}]], ["a"])
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 holds other rows than rank 0 for request 'b'"):
        merge_rows([[{"a": None, "b": [[1] * N]}, {"a": None, "b": [[2] * N]}]], ["a", "b"])


def _span_step(slots, req_ids, tail_ids, tail_pos):
    """A pure decode step (one token per request) of ``req_ids`` with these tail tokens and positions."""
    from higgs_talker.heads.spans import SpanStep

    qsl = torch.arange(len(req_ids) + 1)
    return SpanStep(list(req_ids)).lay_out(slots, torch.tensor(tail_ids), torch.tensor(tail_pos), qsl)


def test_span_step_classifies_rows_opens_streams_and_forces_the_text_token():
    """Row modes from the tail tokens and the slots' state: ``<|audio|>`` opens a stream (at the tail position),
    a stream row is due a frame only at ``seed_pos + rows produced``, a done row is forced EOS and produces
    nothing; audio-mode rows keep only their forced text logit."""
    from higgs_talker.heads.slots import RequestSlots, SlotStore
    from higgs_talker.heads.spans import force_text_logits, forced_only_logits, frame_results

    audio, eos, text = 50, 51, 7
    slots = RequestSlots(SlotStore(4, N, V, BOC, EOC, torch.device("cpu")), seed=0)
    step = _span_step(slots, ["t", "a"], [text, audio], [3, 12])
    step.modes = m = step.row_modes(slots, audio, eos)
    assert m.seed.tolist() == [False, True] and m.audio.tolist() == [False, True]
    assert m.code_rows.tolist() == [False, True] and m.forced.tolist() == [audio, audio]
    step.hidden = torch.randn(2, 4)
    head = lambda h: torch.randn(h.shape[0], N, V)  # noqa: E731
    frame = functools.partial(frame_results, audio_id=audio, eos_id=eos)
    assert step.sample(slots, head, frame, (torch.ones(2), torch.full((2,), V), torch.ones(2))) is None
    assert slots.requests["a"].rows == [] and not slots.requests["a"].active  # recorded when settled
    published = slots.settle()
    assert published[0] is None and published[1].shape == (1, N) and slots.settle() is None
    assert torch.equal(slots.rows_for("a"), published[1]) and slots.requests["a"].active
    assert slots.store.state.has_codes[step.slots].tolist() == [False, True]
    assert slots.seed_pos[step.slots].tolist() == [-1, 12]  # the stream opened at its tail
    # next step: "a" is due at 12 + 1 rows = 13, not at a partial chunk's position 20
    for pos, due in ((13, True), (20, False)):
        m = _span_step(slots, ["t", "a"], [text, audio], [4, pos]).row_modes(slots, audio, eos)
        assert m.seed.tolist() == [False, False] and m.code_rows.tolist() == [False, due]
    chunk = _span_step(slots, ["t", "a"], [text, audio], [4, 20])  # not due: in its stream, but no frame
    chunk.modes, chunk.hidden = chunk.row_modes(slots, audio, eos), torch.randn(2, 4)
    chunk.sample(slots, head, frame, (torch.ones(2), torch.full((2,), V), torch.ones(2)))
    assert slots.settle() == [None, None]
    assert slots.rows_for("a").shape == (1, N) and slots.requests["a"].active
    assert int(slots.store.num_rows[step.slots[1]]) == 1  # the chunk that produced no frame counts no row
    slots.store.state.done[step.slots[1]] = True  # "a" emitted its terminal row, which also ends its codes
    slots.store.state.has_codes[step.slots[1]] = False  # (update_state: has_codes = not done)
    m = _span_step(slots, ["t", "a"], [text, audio], [4, 14]).row_modes(slots, audio, eos)
    assert m.forced.tolist() == [audio, eos] and m.code_rows.tolist() == [False, False] and m.audio[1]
    assert m.seed.tolist() == [False, False]  # its <|audio|> tail after the end opens no new stream
    logits = torch.randn(2, 64)
    want_text = logits[0].clone()
    out = force_text_logits(logits, m)
    assert torch.equal(out[0], want_text) and torch.isfinite(out[1]).tolist() == [i == eos for i in range(64)]
    only = forced_only_logits(m.forced, 64, torch.float32)
    assert [torch.isfinite(r).nonzero().flatten().tolist() for r in only] == [[audio], [eos]]


def test_span_step_text_logits_skip_the_head_only_when_every_request_is_forced():
    """``text_logits`` classifies the rows, keeps them for sampling, and computes the text head unless the host
    knows every request is in audio mode (the step sampled before is settled first: its rows opened a stream)."""
    from types import SimpleNamespace

    from higgs_talker.heads.slots import RequestSlots, SlotStore
    from higgs_talker.heads.spans import frame_results, rows_or_empty

    specials = SimpleNamespace(audio=50, eos=51)
    slots = RequestSlots(SlotStore(4, N, V, BOC, EOC, torch.device("cpu")), seed=0)
    calls = []
    text_head = lambda h: calls.append(h) or torch.zeros(h.shape[0], 64)  # noqa: E731
    step = _span_step(slots, ["t", "a"], [7, 50], [3, 12])
    assert step.laid_out and step.new_rows == [0, 1]
    step.adopt_seeds(slots, {1: 2**63 + 5})  # vLLM's seed for "a", new this step (folded into range)
    assert slots.requests["a"].seed == 5 and int(slots.store.seeds[step.slots[1]]) == 5
    hidden = torch.randn(2, 4)
    logits, skipped = step.text_logits(slots, hidden, specials, text_head, 64)
    assert not skipped and len(calls) == 1 and step.hidden is hidden and step.modes.audio.tolist() == [False, True]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [50] and torch.isfinite(logits[0]).all()
    head = lambda h: torch.randn(h.shape[0], N, V)  # noqa: E731
    frame = functools.partial(frame_results, audio_id=50, eos_id=51)
    step.sample(slots, head, frame, (torch.ones(2), torch.full((2,), V), torch.ones(2)))
    audio_only = _span_step(slots, ["a"], [50], [13])  # "a" is in its stream: known forced on the host once settled
    audio_only.adopt_seeds(slots, {0: 9})  # not new: keeps the seed it sampled with
    assert slots.requests["a"].seed == 5
    logits, skipped = audio_only.text_logits(slots, hidden[:1], specials, text_head, 64)
    assert skipped and len(calls) == 1 and torch.isfinite(logits[0]).nonzero().flatten().tolist() == [50]
    assert audio_only.modes is None and audio_only.forced.tolist() == [50]  # the rows are classified in the frame
    slots.store.state.done[audio_only.slots] = True  # "a" emitted its terminal row: EOS is forced, head still skipped
    ended = _span_step(slots, ["a"], [50], [14])
    logits, skipped = ended.text_logits(slots, hidden[:1], specials, text_head, 64)
    assert skipped and ended.forced.tolist() == [51] and torch.isfinite(logits[0]).nonzero().flatten().tolist() == [51]
    slots.store.state.done[audio_only.slots] = False
    row = slots.rows_for("a")
    assert [r.shape for r in rows_or_empty([None, row, torch.zeros(0, N)], N)] == [(0, N), (1, N), (0, N)]


def test_span_step_feeds_each_decoding_tail_its_last_frame():
    """Feedback: the tail of a stream fed in a one-token span gets the slot's last frame; a multi-token span
    (prefill) and a request not in a stream get none; the buffers cover only the tails."""
    from higgs_talker.heads.slots import RequestSlots, SlotStore
    from higgs_talker.heads.spans import SpanStep

    slots = RequestSlots(SlotStore(4, N, V, BOC, EOC, torch.device("cpu")), seed=0)
    s, _ = slots.sync(["a", "b", "c"])
    state = slots.store.state
    state.has_codes[s] = torch.tensor([True, False, True])
    state.last_codes[s] = torch.arange(3 * N).reshape(3, N)
    qsl = torch.tensor([0, 1, 2, 5])  # "c" is a 3-token span
    step = SpanStep(["a", "b", "c"], slots=s, qsl=qsl, input_ids=torch.zeros(5), positions=torch.arange(5))
    use, codes = torch.ones(8, dtype=torch.bool), torch.zeros(8, N, dtype=torch.long)
    step.write_feedback(slots, use, codes)
    assert use.tolist() == [True, False, False, False, False, False, False, False]
    assert torch.equal(codes[0], state.last_codes[s[0]]) and torch.equal(codes[4], state.last_codes[s[2]])
    embedding = lambda rows: rows.float().sum(-1, keepdim=True).expand(-1, 2)  # noqa: E731
    embeds = torch.full((5, 2), -1.0)
    fed = step.feed_tails(slots, embeds, embedding)  # the same feedback without the buffers
    want = torch.full((5,), -1.0)
    want[0] = state.last_codes[s[0]].sum()
    assert torch.equal(fed[:, 0], want)


def test_step_buffers_feed_from_fixed_storage_or_on_the_tails():
    """A step that fits the buffers is fed from them (written before the forward); a larger one on its tails; a
    cleared buffer feeds nothing, and token copies are kept only for steps that fit."""
    from higgs_talker.heads.slots import RequestSlots, SlotStore
    from higgs_talker.heads.spans import SpanStep, StepBuffers

    slots = RequestSlots(SlotStore(4, N, V, BOC, EOC, torch.device("cpu")), seed=0)
    s, _ = slots.sync(["a", "b"])
    state = slots.store.state
    state.has_codes[s] = True
    state.last_codes[s] = torch.arange(2 * N).reshape(2, N)
    buffers = StepBuffers(4, N, torch.device("cpu"))
    embedding = lambda rows: rows.float().sum(-1, keepdim=True).expand(-1, 2)  # noqa: E731
    step = SpanStep(["a", "b"], slots=s, qsl=torch.tensor([0, 1, 2]))
    buffers.write_decode_feedback(slots, ["a", "b"], s)  # the same step, from its slots alone
    buffers.keep_tokens(torch.tensor([7, 8]), torch.tensor([3, 9]))
    assert buffers.use.tolist() == [True, True, False, False] and buffers.positions[:2].tolist() == [3, 9]
    ids, pos, qsl = buffers.decode_layout(2)  # what a replayed decode graph ran: one token per request
    assert ids.tolist() == [7, 8] and pos.tolist() == [3, 9] and qsl.tolist() == [0, 1, 2]
    want = state.last_codes[s].sum(-1).float()
    assert torch.equal(buffers.feed(torch.zeros(2, 2), embedding, slots, step)[:, 0], want)
    fed, refed = buffers.embed_codes(torch.zeros(2, 2), embedding, slots, step)  # one token each: feedback only
    assert torch.equal(fed[:, 0], want) and refed == 0
    buffers.clear()
    assert torch.equal(buffers.feed(torch.zeros(2, 2), embedding, slots, step), torch.zeros(2, 2))
    big = SpanStep(["a", "b"], slots=s, qsl=torch.tensor([0, 1, 6]))  # 6 tokens: more than the buffers hold
    buffers.write_feedback(big, slots, 6)
    buffers.keep_tokens(torch.arange(6), torch.arange(6))
    assert not buffers.use.any() and buffers.positions[:2].tolist() == [3, 9]
    fed = buffers.feed(torch.zeros(6, 2), embedding, slots, big)[:, 0]
    assert fed.tolist() == [want[0].item(), 0, 0, 0, 0, 0]  # "b"'s tail ends a 5-token span: no feedback
    assert torch.equal(buffers.feed(torch.zeros(6, 2), embedding, slots, None), torch.zeros(6, 2))


def test_decodes_first_qsl_from_counts_prefill_spans_or_position_jumps():
    """Decodes first, one token each; the prefills from their own qsl, as one span, or split at position jumps
    (None unless the jumps give exactly the prefill count); counts that do not add up are ignored."""
    from higgs_talker.heads.spans import decodes_first_qsl

    pos = torch.tensor([100, 101, 0, 1, 2, 5, 6, 7, 8])
    assert decodes_first_qsl(4, pos, 2, 2).tolist() == [0, 1, 2, 5, 9]
    assert decodes_first_qsl(4, pos, 2, 2, torch.tensor([0, 4, 7])).tolist() == [0, 1, 2, 6, 9]
    assert decodes_first_qsl(3, pos, 2, 1).tolist() == [0, 1, 2, 9]
    assert decodes_first_qsl(2, pos[:2], 2, 0).tolist() == [0, 1, 2]
    assert decodes_first_qsl(2, torch.tensor([0, 1, 2, 0, 1]), 5, 5).tolist() == [0, 3, 5]  # counts ignored
    assert decodes_first_qsl(3, pos, 2, 1).dtype == torch.long
    assert decodes_first_qsl(2, torch.arange(5)) is None  # one run of positions cannot be two requests


def test_reference_rows_read_a_voice_clone_info():
    """An info's rows (or a one-element list of them) pair with its placeholder positions, masked rows dropped;
    anything that does not pair up, or no info at all, is None."""
    from higgs_talker.heads.spans import reference_rows

    rows, where = torch.arange(3 * N).reshape(3, N), torch.tensor([4, 5, 6])
    mask = torch.tensor([True, False, True])
    infos = [{"audio_input_ids": [rows], "audio_placeholder_positions": where, "audio_input_ids_mask": mask},
             {"audio_input_ids": rows, "audio_placeholder_positions": where[:2]}, "not a dict", {},
             {"audio_input_ids": rows[:2], "audio_placeholder_positions": where}]  # fmt: skip
    got_where, got_rows = reference_rows(infos, N, 0)
    assert got_where.tolist() == [4, 6] and torch.equal(got_rows, rows[[0, 2]]) and got_rows.dtype == torch.long
    assert all(reference_rows(infos, N, i) is None for i in (1, 2, 3, 4, 5))  # fewer positions; more; none


def test_placeholder_prompts_place_reference_rows_as_explicit_positions_do(caplog):
    """vllm-omni 0.26 passes a voice clone's rows without positions and marks them with -100 tokens in the prompt:
    every way the prompt can be chunked (whole, the run split over three chunks, a chunk boundary right at the run's
    start, a prefix-cache hit that begins inside the run) embeds each row where the explicit positions of vllm-omni
    0.30 put it; a masked row leaves the run's last placeholder unfilled (the kept rows fill the first ones), and
    a first span of placeholders only, its start skipped by a cache hit, places nothing (and warns)."""
    from higgs_talker.heads.slots import RequestSlots, SlotStore
    from higgs_talker.heads.spans import PLACEHOLDER, SpanStep

    r = 5
    ids = torch.tensor([11, 12] + [PLACEHOLDER] * r + [13, 14, 15, 16])  # tts, ref_audio, run, text, words, audio
    rows = torch.arange(r * N).reshape(r, N) % 1000
    embedding = lambda codes: codes.float().sum(-1, keepdim=True).expand(-1, 2)  # noqa: E731
    legacy = {"audio_input_ids": [rows], "audio_input_ids_mask": torch.ones(r, dtype=torch.bool)}
    explicit = {"audio_input_ids": rows, "audio_placeholder_positions": torch.arange(2, 2 + r)}

    def run(info: dict, cuts: list[int], first: int = 0) -> torch.Tensor:
        """The request's prompt from ``first`` on, prefilled in chunks ending at ``cuts``: each position's embedding."""
        slots = RequestSlots(SlotStore(2, N, V, BOC, EOC, torch.device("cpu")), seed=0)
        out, begin = torch.full((ids.numel(),), -1.0), first
        for k, end in enumerate(cuts):
            s, new = slots.sync(["req"])
            assert new == ([0] if k == 0 else [])
            step = SpanStep(["req"], slots=s, qsl=torch.tensor([0, end - begin]), input_ids=ids[begin:end],
                            positions=torch.arange(begin, end), new_rows=new)  # fmt: skip
            embeds, _ = step.prompt_rows(slots, [info], torch.full((end - begin, 2), -1.0), embedding)
            out[begin:end] = embeds[:, 0]
            begin = end
        return out

    want = run(explicit, [ids.numel()])
    assert torch.equal(want[2 : 2 + r], rows.sum(-1).float()) and (want[[0, 1, 7, 8, 9, 10]] == -1).all()
    for cuts, first in [([11], 0), ([4, 6, 11], 0), ([2, 4, 11], 0), ([11], 4), ([9, 11], 3)]:
        assert torch.equal(run(legacy, cuts, first)[first:], want[first:]), (cuts, first)
    masked = legacy | {"audio_input_ids_mask": torch.tensor([True, False, True, True, True])}
    got = run(masked, [4, 11])
    assert torch.equal(got[2:6], rows[[0, 2, 3, 4]].sum(-1).float()) and got[6] == -1  # upstream's first R
    with caplog.at_level(logging.WARNING):
        skipped = run(legacy, [5, 11], 3)
    assert (skipped[3:5] == -1).all() and torch.equal(skipped[5:], want[5:])  # the next chunk counts back
    assert "neither end" in caplog.text


def test_span_step_prompt_rows_place_reference_and_refed_rows_in_multi_token_spans():
    """A multi-token span embeds a voice clone's reference rows at their placeholder positions and, for a
    request recomputed after a preemption, row j of what it produced at ``seed_pos + 1 + j`` (counted as re-fed);
    a one-token span is left to the feedback; ``rows_for`` finds the rows of live and kept finished requests."""
    from higgs_talker.heads.slots import RequestSlots, SlotStore
    from higgs_talker.heads.spans import SpanStep, StepBuffers

    slots = RequestSlots(SlotStore(4, N, V, BOC, EOC, torch.device("cpu")), keep_finished=4, seed=0)
    s, _ = slots.sync(["ref", "back", "dec"])
    back = slots.requests["back"]
    back.rows = [torch.full((1, N), 100 + j, dtype=torch.int32) for j in range(3)]
    slots.seed_pos[back.slot] = 4  # rows fed at positions 5, 6, 7
    slots.requests["dec"].rows = [torch.full((1, N), 7, dtype=torch.int32)]
    qsl = torch.tensor([0, 4, 10, 11])
    positions = torch.tensor([0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 9])  # "back" recomputes 2..7 (a later chunk)
    step = SpanStep(["ref", "back", "dec"], slots=s, qsl=qsl, input_ids=torch.zeros(11), positions=positions)
    ref_rows = torch.arange(2 * N).reshape(2, N)
    infos = [
        {"audio_input_ids": ref_rows, "audio_placeholder_positions": torch.tensor([3, 1])},
        None,
        {"audio_input_ids": ref_rows[:1], "audio_placeholder_positions": torch.tensor([9])},
    ]  # "dec" is at 9 too
    embedding = lambda codes: codes.float().sum(-1, keepdim=True).expand(-1, 2)  # noqa: E731
    embeds = torch.full((11, 2), -1.0)
    out, refed = step.prompt_rows(slots, infos, embeds, embedding)
    buffers = StepBuffers(4, N, torch.device("cpu"))  # fewer than the 11 tokens: the feedback goes on the tails
    assert torch.equal(buffers.embed_codes(embeds, embedding, slots, step, infos)[0][:, 0], out[:, 0])
    want = torch.full((11,), -1.0)
    want[1], want[3] = ref_rows[1].sum(), ref_rows[0].sum()  # reference rows of request 0 at positions 1 and 3
    want[7], want[8], want[9] = (N * (100 + j) for j in range(3))  # "back": positions 5, 6, 7
    assert torch.equal(out[:, 0], want) and refed == 3  # "dec" (one token) untouched
    assert torch.equal(slots.rows_for("back"), torch.cat(back.rows)) and slots.rows_for("nobody") is None
    slots.release(["back"])
    assert slots.rows_for("back").shape == (3, N)  # kept finished
