"""Asynchronous scheduling: decode t + 1 is queued before decode t is published, and nothing a caller sees
changes. Every case runs the same load with ``async_scheduling`` off (the reference) and on; rows, finish
reasons and freed resources must be equal, and the asynchronous run must really have run ahead.

On CPU the steps run synchronously inside ``step()``, but the scheduling is the same code as on CUDA: steps
scheduled before the previous rows are known, requests that end (EOC, limits, cancel) with a step in flight,
admissions queued behind the step in flight, preemption deferred until nothing is, faults in either step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _engine_invariants import LOAD_TEXTS, assert_idle, check_delay_pattern, remember_idle

from higgs_talker.api import HiggsTalker
from higgs_talker.engine import Engine, EngineConfig
from higgs_talker.heads.sampling import SamplingParams

TEXTS = LOAD_TEXTS[:6]


def load() -> list[SamplingParams]:
    """Sampled requests that end on EOC or max_frames, one greedy, one with top-k."""
    temps = [1.0, 0.8, 1.2, 0.0, 1.0, 0.9]
    return [
        SamplingParams(temperature=t, top_k=[-1, 50][i % 2], seed=500 + i, max_frames=18 + 6 * i)
        for i, t in enumerate(temps)
    ]


def engine_for(talker: HiggsTalker, on: bool, **options) -> Engine:
    options = {"max_num_seqs": 8, "max_model_len": 256, **options}
    return Engine(talker.model, talker.cfg, talker.tokenizer.specials, EngineConfig(async_scheduling=on, **options))


def drive(talker: HiggsTalker, engine: Engine, join_at: int = 4, cancel: tuple[int, int] | None = None) -> dict:
    """Half the load at once, the rest joining at step ``join_at``; ``cancel=(step, index)`` cancels a request.

    Checks every step's outputs (each live request at most once, its row the one just recorded) and returns
    {index: (rows, reason)} plus "ahead": the steps after which a decode step was queued on the device.
    """
    params, half = load(), len(TEXTS) // 2
    prompts = [talker.build_prompt(t) for t in TEXTS]
    ids = [engine.add_request(prompts[i], params[i]) for i in range(half)]
    ahead = 0
    for step in range(3000):
        if step == join_at:
            ids += [engine.add_request(prompts[i], params[i]) for i in range(half, len(TEXTS))]
        if cancel is not None and step == cancel[0]:
            assert engine.cancel(ids[cancel[1]])
        if step > join_at and not engine.has_unfinished():
            break
        outs = engine.step()
        seen = [o.request_id for o in outs]
        assert len(seen) == len(set(seen)), f"a request published twice in one step: {seen}"
        for o in outs:
            req = engine.requests[o.request_id]
            if o.row is not None:
                assert torch.equal(o.row[0], req.rows[-1])
            assert o.finished == req.finished
        ahead += engine._ahead is not None
    else:
        pytest.fail("the engine did not go idle")
    result = {"ahead": ahead}
    for i, rid in enumerate(ids):
        req = engine.pop_finished(rid)
        result[i] = (torch.stack(req.rows).long(), req.finish_reason)
    return result


def assert_same(got: dict, want: dict) -> None:
    for i in range(len(TEXTS)):
        rows, reason = got[i]
        want_rows, want_reason = want[i]
        assert reason == want_reason, f"request {i}: finished {reason}, the synchronous run {want_reason}"
        assert torch.equal(rows, want_rows), f"request {i}: rows differ from the synchronous run"
        if reason != "cancelled":
            check_delay_pattern(rows, reason)


class _Idle:
    """A bare engine where ``remember_idle`` / ``assert_idle`` expect a talker."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine


@pytest.fixture(scope="module")
def reference(talker) -> dict:
    return drive(talker, engine_for(talker, False))


def test_async_run_equals_the_synchronous_one(talker, reference):
    engine = engine_for(talker, True)
    remember_idle(_Idle(engine))
    got = drive(talker, engine)
    assert_same(got, reference)
    reasons = {reference[i][1] for i in range(len(TEXTS))}
    assert {"eoc", "max_frames"} <= reasons, f"the load should end both ways, got {reasons}"
    assert reference["ahead"] == 0 and got["ahead"] > 20, got["ahead"]
    assert not engine.scheduler._unpublished
    assert_idle(_Idle(engine))


def test_cancel_while_a_step_runs_ahead(talker):
    engines = {on: engine_for(talker, on) for on in (False, True)}
    for engine in engines.values():
        remember_idle(_Idle(engine))
    results = {on: drive(talker, e, cancel=(9, 1)) for on, e in engines.items()}
    assert results[True]["ahead"] > 0
    assert_same(results[True], results[False])
    assert results[True][1][1] == "cancelled"
    for engine in engines.values():
        assert_idle(_Idle(engine))


def test_cancelling_the_last_request_drops_the_step_ahead(talker):
    engine = engine_for(talker, True)
    remember_idle(_Idle(engine))
    rid = engine.add_request(talker.build_prompt("Hi"), SamplingParams(seed=3, max_frames=40))
    for _ in range(4):
        engine.step()
    assert engine._ahead is not None
    assert engine.cancel(rid)
    assert engine._ahead is None and not engine.scheduler._unpublished
    assert engine.step() == []
    engine.pop_finished(rid)
    assert_idle(_Idle(engine))


def test_the_first_decode_is_queued_behind_the_prefill(talker):
    """A prefill is published while the decode after it already runs, and a join's prefill is queued behind the
    decode in flight."""
    engine = engine_for(talker, True)
    remember_idle(_Idle(engine))
    params = SamplingParams(seed=4, max_frames=12, min_frames=12)
    first = engine.add_request(talker.build_prompt("Hi"), params)
    outs = engine.step()  # the prefill, published behind decode 1
    assert [o.request_id for o in outs] == [first] and engine._ahead is not None
    assert len(engine.scheduler._unpublished) == 1
    engine.step()
    second = engine.add_request(talker.build_prompt("Hello there."), params)
    outs = engine.step()  # decode 2 is published, with the join's prefill queued behind it
    assert [o.request_id for o in outs] == [first] and engine._ahead is not None
    ahead = engine.scheduler._unpublished[-1]
    assert [r.id for r in ahead[0]] == [second] and ahead[1] is not None  # a prefill
    outs = engine.step()  # the join's prefill, published behind a decode of both
    assert [o.request_id for o in outs] == [second] and engine._ahead is not None
    assert [r.id for r in engine.scheduler._unpublished[-1][0]] == [first, second]
    while engine.has_unfinished():
        engine.step()
    got = [torch.stack(engine.pop_finished(r).rows) for r in (first, second)]
    alone = engine_for(talker, False)
    for rows, text in zip(got, ("Hi", "Hello there."), strict=True):
        rid = alone.add_request(talker.build_prompt(text), params)
        while alone.has_unfinished():
            alone.step()
        assert torch.equal(rows, torch.stack(alone.pop_finished(rid).rows)), text
    assert_idle(_Idle(engine))


def test_a_request_that_fills_its_context_after_the_prefill(talker):
    """max_model_len = prompt + 1: one decode after the prefill, then the context ends it, with or without
    running ahead."""
    prompt = talker.build_prompt("Hello there.")
    results = {}
    for on in (False, True):
        engine = engine_for(talker, on, max_model_len=len(prompt) + 1)
        rid = engine.add_request(prompt, SamplingParams(seed=5, max_frames=20))
        while engine.has_unfinished():
            engine.step()
        req = engine.pop_finished(rid)
        results[on] = (req.finish_reason, torch.stack(req.rows))
        assert not engine.scheduler._unpublished
    assert results[True][0] == results[False][0] == "max_model_len"
    assert len(results[True][1]) == 2 and torch.equal(results[True][1], results[False][1])


@pytest.mark.parametrize(("block_size", "num_blocks"), [(16, 13), (4, 34)])
def test_preemption_under_async_scheduling(talker, reference, block_size, num_blocks):
    """A pool too small for the load: preemptions happen (between steps run ahead) and change no code."""
    engine = engine_for(talker, True, block_size=block_size, num_blocks=num_blocks)
    remember_idle(_Idle(engine))
    got = drive(talker, engine)
    assert_same(got, reference)
    assert got["ahead"] > 0
    assert_idle(_Idle(engine))


def test_a_fault_in_the_step_ahead_publishes_the_running_step_first(talker, monkeypatch):
    """Decode t + 1 fails to launch: decode t's rows are still published, then t + 1's requests fail with the
    error; the engine serves the next request exactly."""
    engine = engine_for(talker, True)
    remember_idle(_Idle(engine))
    runner = engine.runner
    real_run = type(runner).run
    calls = {"n": 0}

    def faulty(self, batch):
        calls["n"] += 1
        if calls["n"] == 6:  # the prefill, decodes 1-4, then the fifth decode, queued ahead of the fourth
            raise RuntimeError("injected fault")
        return real_run(self, batch)

    params = SamplingParams(seed=8, max_frames=30, min_frames=30)
    rid = engine.add_request(talker.build_prompt("Hello there."), params)
    monkeypatch.setattr(type(runner), "run", faulty)
    with pytest.raises(RuntimeError, match="injected fault"):
        for _ in range(10):
            engine.step()
    monkeypatch.undo()
    req = engine.pop_finished(rid)
    assert req.finish_reason == "error" and "injected fault" in str(req.error)
    assert len(req.rows) == 5  # the prefill's row and decodes 1-4: the step running under the fault published
    assert_idle(_Idle(engine))
    alone = engine_for(talker, False)
    again = engine.add_request(talker.build_prompt("Hello there."), params)
    other = alone.add_request(talker.build_prompt("Hello there."), params)
    for e in (engine, alone):
        while e.has_unfinished():
            e.step()
    rows = torch.stack(engine.pop_finished(again).rows)
    assert torch.equal(rows, torch.stack(alone.pop_finished(other).rows))
    assert torch.equal(rows[:5], torch.stack(req.rows))
    assert_idle(_Idle(engine))


def test_a_fault_in_a_prefill_queued_ahead_fails_only_the_joining_request(talker, monkeypatch):
    """A request joins while a decode runs; its prefill, queued behind that decode, fails to launch: the decode
    is still published, the joining request fails with the error, and the running one goes on unchanged."""
    engine = engine_for(talker, True)
    remember_idle(_Idle(engine))
    params = SamplingParams(seed=12, max_frames=20, min_frames=20)
    keep = engine.add_request(talker.build_prompt("Hello there."), params)
    for _ in range(3):
        engine.step()
    runner = engine.runner
    real_run = type(runner).run

    def faulty(self, batch):
        if not batch.is_decode:
            raise RuntimeError("injected prefill fault")
        return real_run(self, batch)

    monkeypatch.setattr(type(runner), "run", faulty)
    joining = engine.add_request(talker.build_prompt("Hi"), params)
    with pytest.raises(RuntimeError, match="injected prefill fault"):
        engine.step()
    monkeypatch.undo()
    assert engine.requests[joining].finish_reason == "error" and not engine.requests[keep].finished
    while engine.has_unfinished():
        engine.step()
    got = torch.stack(engine.pop_finished(keep).rows)
    assert "injected prefill fault" in str(engine.pop_finished(joining).error)
    alone = engine_for(talker, False)
    rid = alone.add_request(talker.build_prompt("Hello there."), params)
    while alone.has_unfinished():
        alone.step()
    assert torch.equal(got, torch.stack(alone.pop_finished(rid).rows))
    assert_idle(_Idle(engine))


def test_a_device_fault_while_waiting_fails_both_unpublished_steps(talker, monkeypatch):
    from higgs_talker import engine as engine_module

    engine = engine_for(talker, True)
    remember_idle(_Idle(engine))
    rid = engine.add_request(talker.build_prompt("Hi"), SamplingParams(seed=2, max_frames=30, min_frames=30))
    for _ in range(3):
        engine.step()
    assert engine._ahead is not None and len(engine.scheduler._unpublished) == 1

    def broken(self):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine_module.HostCopy, "wait", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    monkeypatch.undo()
    assert engine._ahead is None and not engine.scheduler._unpublished
    assert engine.pop_finished(rid).finish_reason == "error"
    assert_idle(_Idle(engine))


def test_async_scheduling_option(talker):
    assert engine_for(talker, None).async_scheduling is False  # CPU default: nothing to overlap
    assert engine_for(talker, True).async_scheduling is True
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None, got 'yes'"):
        EngineConfig(async_scheduling="yes")


def test_generate_and_stream_with_async_scheduling(tiny_dir: Path, talker):
    on = HiggsTalker.from_pretrained(tiny_dir, async_scheduling=True)
    assert on.engine.async_scheduling
    params = [SamplingParams(seed=70 + i, max_frames=25) for i in range(3)]
    texts = TEXTS[:3]
    for got, want in zip(on.generate(texts, params), talker.generate(texts, params), strict=True):
        assert torch.equal(got.codes, want.codes) and got.finish_reason == want.finish_reason
    frames = torch.stack(list(on.stream(TEXTS[1], params[1])))
    assert torch.equal(frames, talker.generate(TEXTS[1], params[1]).codes)
    assert not on.engine.requests and on.engine._ahead is None


@pytest.mark.parametrize("extra", [11, 12])
def test_context_limit_with_a_step_in_flight(talker, extra):
    """A request that reaches max_model_len while a step runs ahead: no step is queued past the limit, and it
    ends as in a synchronous run."""
    prompt = talker.build_prompt(TEXTS[1])
    limit = -(-(len(prompt) + extra) // 4) * 4 + (extra - 12)  # a multiple of the block size, and one short
    rows = {}
    for on in (False, True):
        engine = engine_for(talker, on, block_size=4, max_model_len=limit)
        remember_idle(_Idle(engine))
        positions = []
        run = engine.runner.run

        def recording(batch, run=run, positions=positions):
            positions.extend(batch.positions)
            return run(batch)

        engine.runner.run = recording
        room = limit - len(prompt) - (talker.cfg.num_codebooks - 1)  # the most frames the context holds: no EOC before
        rid = engine.add_request(prompt, SamplingParams(seed=9, max_frames=100, min_frames=room))
        while engine.has_unfinished():
            engine.step()
        req = engine.pop_finished(rid)
        assert req.finish_reason == "max_model_len"
        assert max(positions) == limit - 1, (max(positions), limit)
        rows[on] = torch.stack(req.rows)
        assert_idle(_Idle(engine))
    assert torch.equal(rows[True], rows[False])


@pytest.mark.parametrize("on", [False, True], ids=["sync", "async"])
def test_callers_are_not_held_while_a_step_waits_for_the_device(talker, monkeypatch, on):
    """While ``step()`` waits for the device, other threads add and cancel requests at once (the lock is let
    go); what they did is seen by the step's publish: the cancelled request publishes nothing more, the added
    one is prefilled next, and every code equals a run without the interruption."""
    import threading

    from higgs_talker import engine as engine_module

    engine = engine_for(talker, on)
    remember_idle(_Idle(engine))
    params = [SamplingParams(seed=40 + i, max_frames=20) for i in range(3)]
    prompts = [talker.build_prompt(t) for t in TEXTS[:3]]
    ids = [engine.add_request(prompts[i], params[i]) for i in range(2)]
    real_wait = engine_module.HostCopy.wait
    seen = {}

    def wait_with_callers(self):
        if "done" not in seen and len(engine.requests[ids[0]].rows) == 5:
            seen["done"] = True

            def caller() -> None:
                seen["added"] = engine.add_request(prompts[2], params[2])
                seen["cancelled"] = engine.cancel(ids[1])

            t = threading.Thread(target=caller)
            t.start()
            t.join(timeout=30)
            seen["free"] = not t.is_alive()
        return real_wait(self)

    monkeypatch.setattr(engine_module.HostCopy, "wait", wait_with_callers)
    published = {}
    while engine.has_unfinished() or "added" not in seen:
        for o in engine.step():
            published.setdefault(o.request_id, []).append(o)
    monkeypatch.undo()
    assert seen["free"], "add_request / cancel waited for the step (the lock was held over the device wait)"
    assert seen["cancelled"]
    cancelled = engine.pop_finished(ids[1])
    assert cancelled.finish_reason == "cancelled"
    assert len(published[ids[1]]) == len(cancelled.rows)  # nothing published after the cancel
    alone = engine_for(talker, False)
    for rid, i in ((ids[0], 0), (seen["added"], 2)):
        rows = torch.stack(engine.pop_finished(rid).rows)
        other = alone.add_request(prompts[i], params[i])
        while alone.has_unfinished():
            alone.step()
        assert torch.equal(rows, torch.stack(alone.pop_finished(other).rows)), rid
    assert_idle(_Idle(engine))
