"""The engine: batching independence, joining, cancellation, limits, preemption, publication, streaming.

The reference for "what codes must a request get" is either the same request run alone, or a naive decode
loop below that recomputes the whole sequence from scratch every step (no KV-cache reuse, no batching), fed
back exactly as SPEC 4.8 says: position ``P + j`` of a prompt of length ``P`` carries the fused embedding of
delayed row ``j``.
"""

from __future__ import annotations

import re

import pytest
import torch

from higgs_talker.api import HiggsTalker, Reference
from higgs_talker.attention import SdpaAttention, use_backend
from higgs_talker.batch import DeviceBatch, StepBatch
from higgs_talker.engine import Engine, EngineConfig, StepOutput
from higgs_talker.heads.delay import DelayState, apply_delay_mask, codec_frames, update_state
from higgs_talker.heads.sampling import SamplingParams, sample_codes
from higgs_talker.kv_cache import allocate_kv_caches
from higgs_talker.prompt import Prompt

N, BOC, EOC = 8, 1024, 1025
TEXTS = ["Hi", "Hello world", "A somewhat longer sentence, to speak aloud."]


def make_engine(talker: HiggsTalker, **kwargs) -> Engine:
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_model_len", 1024)
    return Engine(talker.model, talker.cfg, talker.tokenizer.specials, EngineConfig(**kwargs))


def check_output(out: StepOutput) -> None:
    assert out.row is not None
    assert out.row.shape == (1, N) and out.row.dtype == torch.int32 and out.row.device.type == "cpu"


def drain(engine: Engine, max_steps: int = 5000) -> dict[str, list[StepOutput]]:
    """Step until idle; every step's outputs are checked, and each running request appears at most once."""
    outs: dict[str, list[StepOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        step = engine.step()
        ids = [o.request_id for o in step]
        assert len(ids) == len(set(ids))
        for o in step:
            check_output(o)
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not go idle")


def rows_of(outs: list[StepOutput]) -> torch.Tensor:
    return torch.cat([o.row for o in outs]).long()


def run_alone(talker: HiggsTalker, prompt: Prompt, params: SamplingParams) -> tuple[torch.Tensor, str]:
    engine = make_engine(talker)
    rid = engine.add_request(prompt, params)
    outs = drain(engine)[rid]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    return rows_of(outs), outs[-1].finish_reason


def fused_sum(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Independent fused embedding: codes [R, N] -> sum over c of table[c * 1026 + code] -> [R, H]."""
    out = torch.zeros(codes.shape[0], table.shape[1], dtype=table.dtype)
    for r in range(codes.shape[0]):
        for c in range(codes.shape[1]):
            out[r] += table[c * 1026 + int(codes[r, c])]
    return out


@torch.no_grad()
def reference_rows(talker: HiggsTalker, prompt: Prompt, params: SamplingParams) -> tuple[torch.Tensor, str]:
    """The naive decode loop: recompute everything each step, sample with (seed, step = row index)."""
    model, cfg = talker.model, talker.cfg
    table = model.multimodal_embedding.weight
    base = model.model.embed_tokens.weight[prompt.input_ids].clone()
    if prompt.audio_codes is not None:
        base[prompt.audio_positions] = fused_sum(table, prompt.audio_codes)
    state = DelayState.allocate(1, N, BOC)
    rows: list[torch.Tensor] = []
    seed = torch.tensor([params.seed if params.seed is not None else 0])  # greedy rows ignore the noise
    top_k = torch.tensor([params.top_k if params.top_k > 0 else cfg.codebook_size])
    while True:
        embeds = torch.cat([base, fused_sum(table, torch.stack(rows))]) if rows else base
        n = embeds.shape[0]
        t = cfg.text
        caches = allocate_kv_caches(t, -(-n // 16), 16, torch.float32, "cpu")
        attn = SdpaAttention(caches, t.num_attention_heads, t.num_key_value_heads, t.head_dim, n)
        blocks = list(range(-(-n // 16)))
        attn.plan(StepBatch([0], list(range(n)), list(range(n)), [n], [n], [blocks], token_ids=[0] * n))
        with use_backend(attn):
            hidden = model(embeds, torch.arange(n))[-1:]
        logits = apply_delay_mask(model.modality_head(hidden).float(), state.delay, state.countdown, BOC, EOC)
        codes = sample_codes(
            logits,
            torch.tensor([float(params.temperature)]),
            top_k,
            torch.tensor([float(params.top_p)]),
            seed,
            torch.tensor([len(rows)]),
        )
        emitted, state = update_state(codes, state, torch.tensor([True]), BOC, EOC)
        rows.append(emitted[0])
        if bool(state.done[0]):
            return torch.stack(rows), "eoc"
        if len(rows) >= params.max_frames + N:  # max_frames audio frames, plus the delay pattern's N rows
            return torch.stack(rows), "max_frames"


def assert_spec_structure(rows: torch.Tensor) -> None:
    """SPEC 4.7 for a naturally ended stream of s + 8 rows (s >= 7): ramp-up, EOC at s, 7 ramp-down rows."""
    r = rows.tolist()
    s = len(r) - 8
    assert s >= 0
    for t, row in enumerate(r):
        for c, x in enumerate(row):
            if t < c:
                assert x == BOC, (t, c, x)
            elif (c == 0 and t >= s) or (c > 0 and t > s + c):
                assert x == EOC, (t, c, x)
            else:
                assert 0 <= x < 1024, (t, c, x)


# --------------------------------------------------------------------------------------------- the reference


@pytest.mark.parametrize(
    "text, params",
    [
        ("Hello world", SamplingParams(seed=3, max_frames=200)),
        ("Hi", SamplingParams(seed=11, temperature=0.8, top_k=50, top_p=0.9, max_frames=24)),
        ("Hi", SamplingParams(seed=13, top_p=0.5, max_frames=24)),  # top-p alone: the filter must still run
        ("Hi", SamplingParams(seed=17, top_k=3, max_frames=24)),  # top-k alone
        ("Hi", SamplingParams(temperature=0.0, max_frames=12)),
    ],
    ids=["sampled_natural_end", "top_k_top_p", "top_p_only", "top_k_only", "greedy"],
)
def test_engine_matches_naive_recompute_loop(talker, text, params):
    prompt = talker.build_prompt(text)
    got, reason = run_alone(talker, prompt, params)
    want, want_reason = reference_rows(talker, prompt, params)
    assert reason == want_reason
    assert torch.equal(got, want)


def test_voice_clone_matches_naive_recompute_loop(talker):
    ref = torch.randint(0, 1024, (5, N), generator=torch.Generator().manual_seed(4))
    prompt = talker.build_prompt("Hello world", Reference(ref, text="Some reference words"))
    assert prompt.audio_codes is not None
    params = SamplingParams(seed=5, max_frames=30)
    got, reason = run_alone(talker, prompt, params)
    want, want_reason = reference_rows(talker, prompt, params)
    assert (reason, torch.equal(got, want)) == (want_reason, True)
    # the reference voice really reaches the model: other reference codes change the output
    other = talker.build_prompt("Hello world", Reference((ref + 1) % 1024, text="Some reference words"))
    assert torch.equal(other.input_ids, prompt.input_ids)
    assert not torch.equal(run_alone(talker, other, params)[0], got)


# --------------------------------------------------------------------------------------------- batching


def test_batched_requests_match_alone(talker):
    cases = [
        (TEXTS[0], SamplingParams(seed=1, max_frames=40)),
        (TEXTS[1], SamplingParams(seed=3, max_frames=60)),
        (TEXTS[2], SamplingParams(seed=7, max_frames=17)),
        (TEXTS[1], SamplingParams(seed=8, max_frames=33, temperature=0.7)),
    ]
    prompts = [talker.build_prompt(t) for t, _ in cases]
    alone = [run_alone(talker, p, s) for p, (_, s) in zip(prompts, cases, strict=True)]
    engine = make_engine(talker)
    ids = [engine.add_request(p, s) for p, (_, s) in zip(prompts, cases, strict=True)]
    outs = drain(engine)
    for rid, (rows, reason) in zip(ids, alone, strict=True):
        assert torch.equal(rows_of(outs[rid]), rows), rid
        assert outs[rid][-1].finish_reason == reason
    assert {len(outs[i]) for i in ids} != {len(outs[ids[0]])}  # the requests really ended at different steps


def test_requests_joining_mid_flight_match_alone(talker):
    cases = [
        (TEXTS[1], SamplingParams(seed=3, max_frames=50)),
        (TEXTS[0], SamplingParams(seed=21, max_frames=30)),
        (TEXTS[2], SamplingParams(seed=22, max_frames=20)),
    ]
    prompts = [talker.build_prompt(t) for t, _ in cases]
    engine = make_engine(talker)
    outs: dict[str, list[StepOutput]] = {}
    ids = []
    join_at = {0: 0, 6: 1, 13: 2}
    for step in range(1000):
        if step in join_at:
            i = join_at[step]
            ids.append(engine.add_request(prompts[i], cases[i][1]))
        if not engine.has_unfinished() and len(ids) == len(cases):
            break
        for o in engine.step():
            check_output(o)
            outs.setdefault(o.request_id, []).append(o)
    for rid, p, (_, s) in zip(ids, prompts, cases, strict=True):
        assert torch.equal(rows_of(outs[rid]), run_alone(talker, p, s)[0]), rid


def test_slots_are_reused_cleanly(talker):
    """More requests than slots: later ones reuse slots of finished ones and still match alone."""
    cases = [
        (TEXTS[0], SamplingParams(seed=30, max_frames=9)),
        (TEXTS[1], SamplingParams(seed=3, max_frames=100)),  # ends naturally (EOC) at 22 rows
        (TEXTS[2], SamplingParams(seed=32, max_frames=15)),
        (TEXTS[0], SamplingParams(seed=33, max_frames=12)),
    ]
    prompts = [talker.build_prompt(t) for t, _ in cases]
    engine = make_engine(talker, max_num_seqs=2)
    ids = [engine.add_request(p, s) for p, (_, s) in zip(prompts, cases, strict=True)]
    outs = drain(engine)
    for rid, p, (_, s) in zip(ids, prompts, cases, strict=True):
        assert torch.equal(rows_of(outs[rid]), run_alone(talker, p, s)[0]), rid
    assert engine.scheduler.free_slots.num_free == 2


def test_prefill_budget_admits_in_several_steps(talker):
    """max_prefill_tokens smaller than the prompts: one prefill per step, codes unchanged."""
    cases = [(t, SamplingParams(seed=80 + i, max_frames=15)) for i, t in enumerate(TEXTS)]
    prompts = [talker.build_prompt(t) for t, _ in cases]
    engine = make_engine(talker, max_prefill_tokens=12)
    ids = [engine.add_request(p, s) for p, (_, s) in zip(prompts, cases, strict=True)]
    first = [{o.request_id for o in engine.step()} for _ in range(3)]
    assert first == [{ids[0]}, {ids[1]}, {ids[2]}]  # each prompt alone exceeds the budget
    outs = drain(engine)
    for rid, p, (_, s) in zip(ids, prompts, cases, strict=True):
        rows = torch.cat([engine.requests[rid].rows[0][None].long(), rows_of(outs[rid])])
        assert torch.equal(rows, run_alone(talker, p, s)[0]), rid


def test_api_batch_generate_matches_single(talker):
    params = [SamplingParams(seed=3, max_frames=80), SamplingParams(seed=40, max_frames=20)]
    texts = [TEXTS[1], TEXTS[2]]
    batch = talker.generate(texts, params)
    for res, text, p in zip(batch, texts, params, strict=True):
        single = talker.generate(text, p)
        assert torch.equal(res.rows, single.rows) and torch.equal(res.codes, single.codes)
        assert res.finish_reason == single.finish_reason
        assert torch.equal(res.codes, codec_frames(res.rows, 1024))
    assert not talker.engine.requests


# --------------------------------------------------------------------------------------------- publication


def test_each_step_publishes_an_owned_int32_row(talker):
    engine = make_engine(talker)
    rid = engine.add_request(talker.build_prompt("Hello world"), SamplingParams(seed=3, max_frames=10))
    other = engine.add_request(talker.build_prompt("Hi"), SamplingParams(seed=4, max_frames=6))
    seen: dict[str, list[torch.Tensor]] = {rid: [], other: []}
    while engine.has_unfinished():
        outs = engine.step()
        running = {r.id for r in engine.scheduler.running}
        for o in outs:
            check_output(o)
            req = engine.requests[o.request_id]
            assert torch.equal(o.row[0], req.rows[-1])  # the row sampled by *this* step, no lag
            assert o.row.data_ptr() != req.rows[-1].data_ptr()
            kept = o.row.clone()
            seen[o.request_id].append(kept)
            o.row.fill_(-7)  # the caller owns its row: scribbling on it must not reach the engine
            assert torch.equal(req.rows[-1], kept[0])
            assert o.finished == (o.request_id not in running)
    for r in (rid, other):
        req = engine.pop_finished(r)
        assert len(req.rows) == len(seen[r]) == req.params.max_frames + N
        assert torch.equal(torch.stack(req.rows), torch.cat(seen[r]))
        assert (torch.stack(req.rows) != -7).all()


def test_published_rows_are_ordinary_tensors(talker):
    engine = make_engine(talker)
    engine.add_request(talker.build_prompt("Hi"), SamplingParams(seed=1, max_frames=2))
    (out,) = engine.step()
    assert not out.row.is_inference()
    out.row[0, 0] = 0  # a consumer masking BOC/EOC in place, as a codec stage might


def test_max_frames_is_honoured(talker):
    prompt = talker.build_prompt(TEXTS[2])
    for max_frames in (1, 5, 13):  # audio frames: the delay pattern adds N rows
        rows, reason = run_alone(talker, prompt, SamplingParams(temperature=0.0, max_frames=max_frames))
        assert (rows.shape, reason) == ((max_frames + N, N), "max_frames")
        assert codec_frames(rows, 1024).shape == (max_frames, N)
    # a natural end before the cap wins
    rows, reason = run_alone(talker, talker.build_prompt("Hello world"), SamplingParams(seed=3, max_frames=500))
    assert reason == "eoc" and rows.shape[0] < 500


def test_min_frames_that_max_model_len_cannot_hold_is_refused_before_anything_is_queued(tiny_dir):
    """A request cut by max_model_len gives its rows less the ramp-up as frames: min_frames up to that is met,
    one more is refused naming it (it was cut short of its minimum, silently)."""
    talker = HiggsTalker.from_pretrained(tiny_dir, max_model_len=200, max_num_seqs=2)
    room = 200 - len(talker.build_prompt("Hi.")) - (N - 1)
    result = talker.generate("Hi.", SamplingParams(seed=1, min_frames=room, max_frames=10**4))
    assert (result.num_frames, result.finish_reason) == (room, "max_model_len")
    with pytest.raises(ValueError, match=re.escape(f"min_frames={room + 1} cannot be reached")):
        talker.generate(["Hi.", "Hi."], [SamplingParams(seed=2), SamplingParams(min_frames=room + 1)])
    assert not talker.engine.has_unfinished() and not talker.engine.requests


def find_natural_endings(talker, count: int, max_frames: int = 250) -> list[tuple[int, torch.Tensor]]:
    found = []
    prompt = talker.build_prompt("Hello world")
    for seed in range(40):
        rows, reason = run_alone(talker, prompt, SamplingParams(seed=seed, max_frames=max_frames))
        if reason == "eoc":
            found.append((seed, rows))
            if len(found) == count:
                return found
    raise AssertionError(f"tiny checkpoint: fewer than {count} of 40 seeds end within {max_frames} rows")


def test_natural_eoc_ending_has_spec_structure(talker):
    for seed, rows in find_natural_endings(talker, 2):
        s = rows.shape[0] - 8
        assert s >= 7, seed  # the tiny model's utterances are longer than the ramp-up
        assert_spec_structure(rows)
        assert rows[s].tolist()[0] == EOC and (rows[:s, 0] < 1024).all()
        assert rows[-1, :7].eq(EOC).all() and rows[-1, 7] < 1024  # the terminal row
        frames = codec_frames(rows, 1024)
        assert frames.shape == (s, N)


def test_short_utterances_keep_the_delay_pattern(make_checkpoint):
    """Codebook 0 ending during the ramp-up (s < 7, SPEC "differs" 7), forced by a checkpoint whose EOC row
    dominates: every stream still has the SPEC 4.7 shape, not-started codebooks stay BOC until their turn."""
    ends = []
    for bias in (30.0, 5.0):
        talker = HiggsTalker.from_pretrained(
            make_checkpoint(name=f"eoc{bias}", eoc_bias=bias), max_num_seqs=1, max_model_len=128
        )
        prompt = talker.build_prompt("Hello world")
        for seed in range(6 if bias < 30 else 1):
            rows, reason = run_alone(talker, prompt, SamplingParams(seed=seed, max_frames=80))
            assert reason == "eoc"
            assert_spec_structure(rows)
            s = rows.shape[0] - 8
            ends.append(s)
            assert codec_frames(rows, 1024).shape == (max(s, 1), N)
    assert ends[0] == 0  # EOC at the prefill step: 8 rows, one (kept) frame
    assert any(0 < s < 7 for s in ends), ends


def test_finished_request_frees_its_resources(talker):
    engine = make_engine(talker, max_num_seqs=3)
    sched = engine.scheduler
    free0, slots0 = sched.blocks.num_free, sched.free_slots.num_free
    rid = engine.add_request(talker.build_prompt("Hello world"), SamplingParams(seed=3, max_frames=200))
    drain(engine)
    req = engine.pop_finished(rid)
    assert req.finish_reason == "eoc" and req.blocks == [] and req.slot == -1
    assert sched.blocks.num_free == free0 and sched.free_slots.num_free == slots0
    assert not sched.running and not sched.waiting and rid not in engine.requests


# --------------------------------------------------------------------------------------------- cancel


def test_cancel_frees_blocks_and_slots(talker):
    engine = make_engine(talker, max_num_seqs=3, block_size=4)
    sched = engine.scheduler
    free0, slots0 = sched.blocks.num_free, sched.free_slots.num_free
    params = SamplingParams(temperature=0.0, max_frames=500)
    a = engine.add_request(talker.build_prompt(TEXTS[2]), params)
    b = engine.add_request(talker.build_prompt(TEXTS[1]), params)
    for _ in range(12):
        engine.step()
    req_a = engine.requests[a]
    held = len(req_a.blocks)
    assert held >= 2 and req_a.slot >= 0
    before = sched.blocks.num_free
    assert engine.cancel(a) is True
    assert sched.blocks.num_free == before + held
    assert sched.free_slots.num_free == slots0 - 1
    assert engine.requests[a].finish_reason == "cancelled"
    assert engine.cancel(a) is False  # already finished
    assert engine.cancel("no-such-request") is False
    c = engine.add_request(talker.build_prompt("Hi"), params)  # still waiting: cancel before it ever ran
    assert engine.cancel(c) is True and engine.requests[c].status.value == "finished"
    for _ in range(3):
        outs = engine.step()
        assert {o.request_id for o in outs} == {b}  # the cancelled requests never produce again
    assert engine.cancel(b) is True
    assert sched.blocks.num_free == free0
    assert sched.free_slots.num_free == slots0
    assert not engine.has_unfinished() and engine.step() == []


def test_cancel_during_a_batch_keeps_the_others_exact(talker):
    prompts = [talker.build_prompt(t) for t in TEXTS]
    params = [SamplingParams(seed=50 + i, max_frames=25) for i in range(3)]
    engine = make_engine(talker)
    ids = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    outs: dict[str, list[StepOutput]] = {}
    for step in range(200):
        if step == 7:
            engine.cancel(ids[1])
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    for i in (0, 2):
        assert torch.equal(rows_of(outs[ids[i]]), run_alone(talker, prompts[i], params[i])[0])


# --------------------------------------------------------------------------------------------- limits


def test_max_model_len_ends_a_request(talker):
    prompt = talker.build_prompt("Hi")
    engine = make_engine(talker, max_model_len=len(prompt) + 10, block_size=4)
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_frames=500))
    outs = drain(engine)[rid]
    assert outs[-1].finish_reason == "max_model_len"
    assert len(outs) == 11  # prompt P + 10 fed rows fill the context; the 11th row is sampled from it
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(talker.build_prompt("x" * 20), SamplingParams())


def test_engine_rejects_bad_requests(talker):
    engine = make_engine(talker)
    prompt = talker.build_prompt("Hi")
    engine.add_request(prompt, request_id="dup")
    with pytest.raises(ValueError, match="dup"):
        engine.add_request(prompt, request_id="dup")
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request(prompt, {"seed": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not finished"):
        engine.pop_finished("dup")
    engine.cancel("dup")
    for bad in ({"max_num_seqs": 0}, {"block_size": 0}, {"num_blocks": 0}, {"max_model_len": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)


@pytest.mark.parametrize("bad", [[257, 258, 65, 259], torch.tensor([257, 258, 65, 259])], ids=["list", "tensor"])
def test_engine_rejects_a_non_prompt(talker, bad):
    engine = make_engine(talker)
    with pytest.raises(TypeError, match="Prompt"):
        engine.add_request(bad, SamplingParams(max_frames=2))


def test_preemption_keeps_codes_exact(talker):
    cases = [
        (TEXTS[0], SamplingParams(seed=60, max_frames=45)),
        (TEXTS[1], SamplingParams(seed=3, max_frames=60)),
        (TEXTS[2], SamplingParams(seed=62, max_frames=40)),
        (TEXTS[1], SamplingParams(seed=63, max_frames=50)),
    ]
    prompts = [talker.build_prompt(t) for t, _ in cases]
    engine = make_engine(talker, block_size=4, num_blocks=30)
    free0 = engine.scheduler.blocks.num_free
    ids = [engine.add_request(p, s) for p, (_, s) in zip(prompts, cases, strict=True)]
    outs = drain(engine)
    assert sum(engine.requests[i].preemptions for i in ids) > 0, "the cache was not small enough to preempt"
    for rid, p, (_, s) in zip(ids, prompts, cases, strict=True):
        want, reason = run_alone(talker, p, s)
        assert torch.equal(torch.stack(engine.requests[rid].rows).long(), want), rid
        assert engine.requests[rid].finish_reason == reason
        # every published row is one row of the final sequence, in order (nothing published twice)
        assert torch.equal(rows_of(outs[rid]), want), rid
    assert engine.scheduler.blocks.num_free == free0


def test_preemption_of_a_voice_clone_request(talker):
    """A resumed voice-clone request recomputes its reference rows at the recorded positions."""
    ref = torch.randint(0, 1024, (6, N), generator=torch.Generator().manual_seed(1))
    prompts = [talker.build_prompt("Hi"), talker.build_prompt("Hello there", Reference(ref))]
    params = [SamplingParams(seed=6, max_frames=40), SamplingParams(seed=7, max_frames=40)]
    engine = make_engine(talker, block_size=4, num_blocks=16)
    ids = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    outs = drain(engine)
    assert engine.requests[ids[1]].preemptions > 0
    for rid, p, s in zip(ids, prompts, params, strict=True):
        assert torch.equal(rows_of(outs[rid]), run_alone(talker, p, s)[0]), rid


def test_request_larger_than_the_cache_is_refused(talker):
    engine = make_engine(talker, block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request(talker.build_prompt(TEXTS[2]), SamplingParams())


# --------------------------------------------------------------------------------------------- streaming


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=3, max_frames=200),
        SamplingParams(seed=70, max_frames=22),
        SamplingParams(seed=1, max_frames=2),
        SamplingParams(seed=1, max_frames=1),
    ],
    ids=["natural_end", "cut", "two_frames", "one_frame"],
)
def test_stream_equals_generate(talker, params):
    frames = list(talker.stream("Hello world", params))
    result = talker.generate("Hello world", params)
    assert all(f.shape == (N,) and f.dtype == torch.long for f in frames)
    got = torch.stack(frames) if frames else torch.zeros(0, N, dtype=torch.long)
    assert torch.equal(got, result.codes)
    assert not talker.engine.requests


def test_stream_closed_early_cancels(talker):
    free0 = talker.engine.scheduler.blocks.num_free
    stream = talker.stream("Hello world", SamplingParams(temperature=0.0, max_frames=300))
    first = [next(stream) for _ in range(3)]
    stream.close()
    assert len(first) == 3
    assert not talker.engine.has_unfinished() and not talker.engine.requests
    assert talker.engine.scheduler.blocks.num_free == free0


def test_stream_audio_wakes_its_thread_once_a_chunk_not_every_step(talker, monkeypatch):
    """A streamed audio request's thread sleeps until the frames of its next codec chunk exist (one wake-up a chunk,
    and one at its end), where a frame stream's wakes after every step: with many streams, a thread woken every
    step per stream took the host from the engine's own thread. Its audio is the one-shot decode all the same."""
    from higgs_talker.codec.streaming import UPSTREAM_CHUNKING, AudioChunking
    from higgs_talker.driver import Ticket

    waits = []
    real_wait = Ticket.wait
    monkeypatch.setattr(Ticket, "wait", lambda self: (waits.append(1), real_wait(self))[1])
    params = SamplingParams(seed=5, min_frames=200, max_frames=200)
    for chunking in (UPSTREAM_CHUNKING, AudioChunking()):
        waits.clear()
        chunks = list(talker.stream_audio("Hello world", params, chunking=chunking))
        assert len(waits) <= len(chunks) + 3, (chunking, len(waits), len(chunks))
    torch.testing.assert_close(torch.cat(chunks), talker.generate("Hello world", params).audio, atol=1e-5, rtol=0)
    waits.clear()
    frames = list(talker.stream("Hello world", params))
    assert len(frames) == 200 and len(waits) >= 150  # a frame stream needs every frame as it comes


def test_unseeded_requests_differ(talker):
    a = talker.generate("Hello world", SamplingParams(max_frames=12))
    b = talker.generate("Hello world", SamplingParams(max_frames=12))
    assert not torch.equal(a.rows, b.rows)


def test_min_frames_holds_the_end_of_stream_back(talker):
    """A request that ends early on its own keeps going to at least min_frames rows before codebook 0 may
    sample EOC; everything before that point is unchanged (the mask only removes EOC)."""
    free = None
    for seed in range(40):
        res = talker.generate("Short.", SamplingParams(seed=seed, max_frames=300))
        if res.finish_reason == "eoc" and res.num_rows < 60:
            free = (seed, res)
            break
    assert free is not None, "no early-ending seed found for the tiny checkpoint"
    seed, res = free
    eoc_row = res.num_rows - 8  # the row where codebook 0 sampled EOC
    held = talker.generate("Short.", SamplingParams(seed=seed, max_frames=300, min_frames=eoc_row + 20))
    assert torch.equal(held.rows[:eoc_row], res.rows[:eoc_row])
    onset = (held.rows[:, 0] == 1025).nonzero()
    assert onset.numel() == 0 or int(onset[0]) >= eoc_row + 20
    assert held.num_rows >= eoc_row + 20


@pytest.mark.parametrize("bad", [-1, 2**31, 1.5, True])
def test_min_frames_is_validated(bad):
    with pytest.raises(ValueError, match="min_frames"):
        SamplingParams(max_frames=300, min_frames=bad)


def test_min_frames_is_checked_against_the_max_frames_a_request_ends_up_with(talker):
    """SamplingParams(min_frames=3000) is valid beside its default max_frames=2048: generate(max_frames=...)
    may raise the cap. min above max is refused where the request is queued, naming both values."""
    assert SamplingParams(min_frames=3000).min_frames == 3000
    params = SamplingParams(seed=1, max_frames=20, min_frames=30)
    res = talker.generate("Hi.", params, max_frames=30)
    assert res.num_frames == 30 and res.finish_reason == "max_frames"
    with pytest.raises(ValueError, match=re.escape("min_frames=30 is more than max_frames=20")):
        talker.generate("Hi.", params)
    with pytest.raises(ValueError, match=re.escape("min_frames=30 is more than max_frames=29")):
        talker.generate(["Hi.", "Ho."], [SamplingParams(), params], max_frames=29)
    with pytest.raises(ValueError, match=re.escape("min_frames=30 is more than max_frames=20")):
        talker.engine.add_request(talker.build_prompt("Hi."), params)
    assert not talker.engine.requests  # nothing was queued


# --------------------------------------------------------------------------------------------- step inputs


def test_decode_batch_padding_uses_the_scratch_slot_and_block(talker):
    """The one padding rule: padding requests are one token at position 0 on the scratch slot, writing their K/V
    into the scratch block; the real requests are unchanged, and the padded batch still runs."""
    engine = make_engine(talker)
    params = [SamplingParams(seed=i, max_frames=4) for i in range(len(TEXTS))]
    for t, p in zip(TEXTS, params, strict=True):
        engine.add_request(talker.build_prompt(t), p)
    engine.step()  # prefill all three
    sched, runner = engine.scheduler, engine.runner
    batch = sched.schedule([])
    assert batch.is_decode and batch.num_reqs == 3 and not batch.new_slots
    scratch, block, bs = runner.slots.scratch, runner.scratch_block, engine.config.block_size
    padded = runner.padded(batch, 5)
    assert padded.slots == batch.slots + [scratch] * 2
    assert padded.positions == batch.positions + [0, 0]
    assert padded.slot_mapping == batch.slot_mapping + [block * bs] * 2
    assert padded.seq_lens == batch.seq_lens + [1, 1] and padded.query_lens == [1] * 5
    assert padded.block_tables == batch.block_tables + [[block]] * 2
    assert runner.padded(batch, 3) is batch
    with pytest.raises(ValueError, match="can only pad a decode batch up: a decode batch of 3 requests -> 2"):
        runner.padded(batch, 2)
    assert padded.decode_packed().tolist() == [padded.slots, padded.positions]
    dev = padded.to_device(engine.device)
    assert dev.slots.untyped_storage().data_ptr() == dev.positions.untyped_storage().data_ptr()  # one upload
    runner.attn.plan_bucket(padded)
    rows = runner.forward(dev)[:3]
    outs = sched.publish(rows.cpu())
    assert [o.request_id for o in outs] == [r for r in engine.requests] and all(o.row is not None for o in outs)
    prefill = StepBatch([0], [0, 1], [0, 1], [2], [2], [[0]], token_ids=[1, 2])
    with pytest.raises(ValueError, match="can only pad a decode batch up: a prefill batch"):
        runner.padded(prefill, 4)


def test_padding_batch_points_at_the_scratch_slot(talker):
    """A full-decode graph is captured on an all-padding batch: scratch slot, position 0."""
    runner = make_engine(talker).runner
    packed = runner.padding_batch(4).decode_packed()
    assert packed.dtype == torch.long and packed.tolist() == [[runner.slots.scratch] * 4, [0] * 4]
    static = DeviceBatch.decode(packed)
    packed[1] = 7
    assert static.positions.tolist() == [7] * 4  # a graph's static inputs are views of one buffer


@pytest.mark.parametrize("buckets", [[1, 2, 4, 8], [8]])
def test_bucket_path_gives_the_same_codes_as_eager_on_cpu(talker, buckets):
    """The graph runner without graphs (mode eager) pads every decode step to its bucket and plans the bucket's
    fixed attention buffers; on CPU that is SDPA's bucket path. Codes equal the plain eager engine's."""
    cases = [(TEXTS[i % 3], SamplingParams(seed=90 + i, max_frames=20 + 3 * i)) for i in range(5)]
    prompts = [talker.build_prompt(t) for t, _ in cases]
    plain, bucketed = make_engine(talker), make_engine(talker)
    bucketed.warm_up("eager", buckets)
    assert bucketed.graphs is not None and bucketed.graphs.path_for(8) == "eager"
    results = []
    for engine in (plain, bucketed):
        ids = [engine.add_request(p, s) for p, (_, s) in zip(prompts, cases, strict=True)]
        outs = drain(engine)
        results.append([rows_of(outs[i]) for i in ids])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_cpu_kv_cache_is_sized_from_a_memory_budget(talker, monkeypatch):
    """Without num_blocks the KV cache takes at most kv_memory_fraction of the free memory (CPU included): fewer
    blocks than max_num_seqs full-length sequences when that is all that fits, a clear error when not even one
    full-length sequence fits."""
    import higgs_talker.kv_cache as kv_cache

    # the budget's unit, against what one block of the allocated cache really holds (K and V, every layer)
    one_block = kv_cache.allocate_kv_caches(talker.cfg.text, 1, 16, torch.float32, "cpu")
    per_block = kv_cache.kv_bytes_per_token(talker.cfg.text, torch.float32) * 16
    assert per_block == sum(t.numel() * t.element_size() for t in one_block)
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: int(100 * per_block / 0.6) + 1)
    engine = make_engine(talker, max_num_seqs=8, max_model_len=1024)  # 8 x 64 blocks wanted, 100 fit
    assert engine.scheduler.blocks.num_blocks == 100
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: int(10 * per_block / 0.6))
    with pytest.raises(ValueError, match="KV cache for one 1024-token sequence .* does not fit"):
        make_engine(talker, max_num_seqs=8, max_model_len=1024)
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: 0)
    with pytest.raises(ValueError, match="not one KV block of 16 tokens"):
        make_engine(talker)
