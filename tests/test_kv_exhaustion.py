"""KV-cache exhaustion: a pool too small for the offered load queues and preempts, and changes no code.

A preempted request gives its blocks back and is later recomputed (prompt plus every fed-back row in one
prefill), so its codes must not change (beyond a floating-point near-tie flip, which ``explain_divergence``
proves against the request run alone; on this machine none occurs for these seeds). A request that could
not fit even with the whole pool to itself must fail with a clear error instead of spinning forever.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _engine_invariants import LOAD_TEXTS, assert_idle, check_delay_pattern, explain_divergence, remember_idle

from higgs_talker.api import HiggsTalker
from higgs_talker.heads.sampling import SamplingParams

TEXTS = LOAD_TEXTS


def offered_load() -> list[SamplingParams]:
    # sampled runs end on EOC or at max_frames; one greedy run always goes to max_frames
    temps = [1.0, 0.8, 1.0, 0.0, 1.2, 1.0, 0.9, 1.0]
    return [
        SamplingParams(temperature=t, top_k=[-1, 50][i % 2], seed=1000 + i, max_frames=22 + 5 * i)
        for i, t in enumerate(temps)
    ]


def drive(talker: HiggsTalker, params: list[SamplingParams], max_steps: int = 5000) -> tuple[dict, dict]:
    """Run every text at once through the engine; returns ({text index: (rows, reason)}, figures)."""
    e = talker.engine
    ids = [e.add_request(talker.build_prompt(t), p) for t, p in zip(TEXTS, params, strict=True)]
    figures = {"queued_while_running": 0, "preemptions": 0, "steps": 0}
    for _ in range(max_steps):
        if not e.has_unfinished():
            break
        if e.scheduler.waiting and e.scheduler.running:
            figures["queued_while_running"] += 1
        e.step()
        figures["steps"] += 1
    else:
        pytest.fail(f"no progress after {max_steps} steps")
    out = {}
    for i, rid in enumerate(ids):
        req = e.pop_finished(rid)
        figures["preemptions"] += req.preemptions
        out[i] = (torch.stack(req.rows).long(), req.finish_reason)
    assert_idle(talker)
    return out, figures


@pytest.fixture(scope="module")
def unconstrained(tiny_dir: Path) -> dict:
    talker = remember_idle(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=256))
    results, figures = drive(talker, offered_load())
    assert figures["preemptions"] == 0 and figures["queued_while_running"] == 0
    return results


@pytest.fixture(scope="module")
def solo(tiny_dir: Path) -> HiggsTalker:
    """A one-seat engine: each request alone, the arbiter when two batched runs disagree."""
    return remember_idle(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=1, max_model_len=256))


def assert_same_codes(results: dict, reference: dict, solo: HiggsTalker) -> None:
    """Each request's rows and finish reason equal the reference run's.

    Where they do not, both runs must agree with the request run alone, up to a code flipped at a
    floating-point near-tie (``explain_divergence``): a batch of 1 and a batch of 8 round differently.
    """
    for i, (rows, reason) in results.items():
        want_rows, want_reason = reference[i]
        check_delay_pattern(rows, reason)
        if torch.equal(rows, want_rows):
            assert reason == want_reason, f"request {i}: {reason} vs {want_reason}"
            continue
        prompt, params = solo.build_prompt(TEXTS[i]), offered_load()[i]
        e = solo.engine
        rid = e.add_request(prompt, params)
        while e.has_unfinished():
            e.step()
        alone = torch.stack(e.pop_finished(rid).rows).long()
        for name, candidate in (("constrained", rows), ("reference", want_rows)):
            if not torch.equal(candidate, alone):
                assert explain_divergence(solo, prompt, params, candidate, alone) is not None, (
                    f"request {i}: {name} run differs from the solo run without a differing row"
                )


@pytest.mark.parametrize(
    ("block_size", "num_blocks"),
    [(16, 8), (16, 13), (4, 34), (8, 36)],
    ids=["16x8-one-at-a-time", "16x13", "4x34", "8x36"],
)
def test_small_pool_gives_the_same_codes(tiny_dir: Path, unconstrained, solo, block_size: int, num_blocks: int) -> None:
    talker = remember_idle(
        HiggsTalker.from_pretrained(
            tiny_dir, max_num_seqs=8, max_model_len=256, block_size=block_size, num_blocks=num_blocks
        )
    )
    rows = [p.max_frames + 8 for p in offered_load()]  # audio frames plus the delay pattern's 8 rows
    longest = max(len(talker.build_prompt(t)) + r for t, r in zip(TEXTS, rows, strict=True))
    assert longest + 1 <= block_size * num_blocks, "every request must fit the pool when it has it to itself"
    results, figures = drive(talker, offered_load())
    assert figures["queued_while_running"] + figures["preemptions"] > 0, "the pool was not too small"
    assert_same_codes(results, unconstrained, solo)


def test_small_pool_preempts(tiny_dir: Path, unconstrained, solo) -> None:
    """The tightest pool above must actually preempt (not only queue), or the recompute path is untested."""
    talker = remember_idle(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=256, num_blocks=13))
    results, figures = drive(talker, offered_load())
    assert figures["preemptions"] > 0, figures
    assert_same_codes(results, unconstrained, solo)


def test_small_pool_through_generate(tiny_dir: Path, unconstrained, solo) -> None:
    """The public batch API on a small pool returns the codes of the unconstrained engine."""
    talker = remember_idle(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=256, num_blocks=10))
    results = talker.generate(TEXTS, offered_load())
    assert_same_codes({i: (r.rows, r.finish_reason) for i, r in enumerate(results)}, unconstrained, solo)
    assert_idle(talker)


def test_unconstrained_run_matches_solo_runs(unconstrained, solo) -> None:
    """The reference itself: the batch of eight on a roomy pool gives each request its solo codes."""
    alone = {}
    for i, (text, params) in enumerate(zip(TEXTS, offered_load(), strict=True)):
        e = solo.engine
        rid = e.add_request(solo.build_prompt(text), params)
        while e.has_unfinished():
            e.step()
        req = e.pop_finished(rid)
        alone[i] = (torch.stack(req.rows).long(), req.finish_reason)
    assert_same_codes(unconstrained, alone, solo)


def test_prompt_larger_than_the_pool_is_refused(tiny_dir: Path) -> None:
    talker = remember_idle(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=2, max_model_len=256, num_blocks=2))
    prompt = talker.build_prompt("x" * 40)  # 43 tokens > 2 blocks of 16
    with pytest.raises(ValueError, match="prompt of 43 tokens does not fit the KV cache"):
        talker.engine.add_request(prompt, SamplingParams(max_frames=4))
    assert_idle(talker)


def test_request_that_can_never_fit_fails_clearly(tiny_dir: Path) -> None:
    """Prompt fits, but its generation outgrows the whole pool: a clear error within a bounded number of steps.

    A second request that fits keeps running meanwhile and gets exactly the codes it gets alone.
    """
    talker = remember_idle(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=2, max_model_len=256, num_blocks=4))
    e = talker.engine
    fits = SamplingParams(temperature=1.0, seed=5, max_frames=30)
    alone = talker.generate("Fine.", fits).rows  # 9 prompt tokens + 30 rows: 3 blocks
    assert_idle(talker)

    small = e.add_request(talker.build_prompt("Fine."), fits)
    big = e.add_request(talker.build_prompt("hello world hello world"), SamplingParams(temperature=0, max_frames=200))
    with pytest.raises(RuntimeError, match=f"request '{big}' needs 5 KV blocks but the cache has 4 in all"):
        for _ in range(500):
            e.step()
    assert e.requests[small].finish_reason is not None
    assert torch.equal(torch.stack(e.pop_finished(small).rows).long(), alone)
    # the request that can never fit is failed once (not left to block every later step); all is free again
    assert e.requests[big].finish_reason == "error"
    assert not e.cancel(big)
    e.step()  # nothing left to run: no error any more
    e.pop_finished(big)
    assert_idle(talker)
    assert torch.equal(talker.generate("Fine.", fits).rows, alone)


def test_block_counts_and_the_context_limit_at_their_edges(talker):
    """At the limits themselves: a block count at exact multiples of the block size, and a prompt that leaves
    exactly one row (admitted) or none (refused, naming max_model_len)."""
    from higgs_talker.engine import Engine, EngineConfig
    from higgs_talker.kv_cache import BlockAllocator

    blocks = BlockAllocator(4, 16)
    assert [blocks.blocks_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    prompt = talker.build_prompt("Hello there.")
    sp = talker.tokenizer.specials
    fits = Engine(talker.model, talker.cfg, sp, EngineConfig(max_num_seqs=1, max_model_len=len(prompt) + 1))
    fits.scheduler.check_fits(prompt)
    full = Engine(talker.model, talker.cfg, sp, EngineConfig(max_num_seqs=1, max_model_len=len(prompt)))
    with pytest.raises(ValueError, match=f"leaves no room within max_model_len={len(prompt)}"):
        full.scheduler.check_fits(prompt)


@pytest.mark.parametrize("prompt_text", ["Hi.", "A somewhat longer prompt, to move the boundary."])
def test_min_frames_the_kv_cache_cannot_hold_is_refused_before_anything_is_queued(tiny_dir: Path, prompt_text) -> None:
    """A request whose min_frames need more K/V than the whole cache holds cannot end well (it would run until the
    cache is full and fail there): it is refused when it is prepared, naming min_frames. The largest min_frames
    accepted runs to the end alone (the boundary is exact, not a margin)."""
    from higgs_talker.prompt import PromptTooLong

    talker = remember_idle(HiggsTalker.from_pretrained(tiny_dir, num_blocks=8, max_num_seqs=1))
    prompt = talker.build_prompt(prompt_text)
    largest = max(m for m in range(1, 200) if _fits(talker, prompt, m))
    result = talker.generate(prompt_text, SamplingParams(seed=1, min_frames=largest, max_frames=largest))
    assert result.codes.shape[0] == largest and result.finish_reason == "max_frames"
    with pytest.raises(PromptTooLong, match=rf"min_frames={largest + 1} cannot be reached: .* need 9 KV blocks, the "
                                            r"cache has 8"):  # fmt: skip
        talker.prepare(prompt_text, SamplingParams(min_frames=largest + 1, max_frames=largest + 1))
    assert not talker.engine.requests
    assert_idle(talker)


def _fits(talker: HiggsTalker, prompt, min_frames: int) -> bool:
    try:
        talker.engine.scheduler.check_fits(prompt, min_frames)
    except ValueError:
        return False
    return True
