"""Prefix caching (``EngineConfig.prefix_caching``): the allocator's reference counts and cache, the prefix hash,
and the engine: a request whose prompt starts like an earlier one prefills only the rest, and its rows equal
those of an engine without the cache (which tests/test_engine.py checks against a naive recompute loop).
"""

from __future__ import annotations

import pytest
import torch
from _engine_invariants import LOAD_TEXTS, assert_idle, remember_idle

from higgs_talker.api import HiggsTalker, Reference
from higgs_talker.engine import Engine, EngineConfig
from higgs_talker.heads.sampling import SamplingParams
from higgs_talker.kv_cache import BlockAllocator, prefix_hashes
from higgs_talker.prompt import Prompt

BS = 4  # small blocks: the tiny prompts span several


# --------------------------------------------------------------------------------------------- allocator


def test_freed_cached_blocks_stay_findable_until_reused_oldest_first():
    a = BlockAllocator(4, BS)
    blocks = a.allocate(3)
    for b, h in zip(blocks, (b"x", b"y", b"z"), strict=True):
        a.register(b, h)
    assert a.lookup([b"x", b"y", b"q", b"z"]) == blocks[:2]  # the longest run from the start
    a.free([blocks[1]])
    a.free([blocks[0]])
    a.free([blocks[2]])
    assert a.num_free == 4 and a.num_cached == 3
    assert a.lookup([b"x", b"y", b"z"]) == blocks  # freed, still cached
    fresh = a.allocate(2)  # the never-used block first, then the cached block freed first (y's)
    assert fresh[0] not in blocks and fresh[1] == blocks[1]
    assert a.lookup([b"x", b"y"]) == [blocks[0]] and a.num_cached == 2
    assert a.num_free == 2


def test_shared_blocks_are_counted_per_holder():
    a = BlockAllocator(3, BS)
    (b,) = a.allocate(1)
    a.register(b, b"p")
    a.share([b])
    assert a.refs(b) == 2
    a.free([b])
    assert a.refs(b) == 1 and a.num_free == 2  # still held once: not free
    a.free([b])
    assert a.refs(b) == 0 and a.num_free == 3
    a.share([b])  # an unheld cached block is taken back from the free pool
    assert a.refs(b) == 1 and a.num_free == 2
    a.free([b])
    with pytest.raises(RuntimeError, match=f"block {b} freed but not allocated"):
        a.free([b])


def test_register_keeps_the_first_block_of_a_prefix_and_refuses_what_is_not_held():
    a = BlockAllocator(3, BS)
    b0, b1 = a.allocate(2)
    a.register(b0, b"p")
    a.register(b1, b"p")  # the same prefix computed twice (one admission): the first block stays the cached one
    assert a.lookup([b"p"]) == [b0] and a.num_cached == 1
    a.free([b1])
    assert a.num_cached == 1 and a.lookup([b"p"]) == [b0]
    with pytest.raises(RuntimeError, match=f"block {b1} is registered but not allocated"):
        a.register(b1, b"q")
    with pytest.raises(RuntimeError, match=f"block {b1} holds no cached prefix"):
        a.share([b1])
    with pytest.raises(RuntimeError, match="KV cache exhausted: 3 blocks requested, 2 free"):
        a.allocate(3)


# --------------------------------------------------------------------------------------------- the hash


def prompt_of(ids: list[int], audio: dict[int, list[int]] | None = None) -> Prompt:
    if not audio:
        return Prompt(torch.tensor(ids))
    pos = sorted(audio)
    return Prompt(torch.tensor(ids), torch.tensor([audio[p] for p in pos]), torch.tensor(pos))


def test_a_prefix_hash_names_every_token_and_code_up_to_its_block():
    ids = list(range(10, 24))  # 14 tokens: 3 full blocks of 4, 2 left over
    base = prefix_hashes(prompt_of(ids), BS)
    assert len(base) == 3 and len(set(base)) == 3
    changed = ids.copy()
    changed[5] = 99  # in block 1
    got = prefix_hashes(prompt_of(changed), BS)
    assert got[0] == base[0] and got[1] != base[1] and got[2] != base[2]  # a later block names its whole prefix
    assert prefix_hashes(prompt_of(ids[:13] + [7]), BS) == base  # the partial block is never hashed
    voice = {6: [1, 2, 3], 7: [4, 5, 6]}
    a, b = (prefix_hashes(prompt_of(ids, v), BS) for v in (voice, {6: [1, 2, 3], 7: [4, 5, 7]}))
    assert a[0] == base[0] and a[1] != base[1]  # reference codes are part of the prefix
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # another voice, the same text: block 0 only
    # the same code row one position earlier in the same block (same ids): another prompt, another K/V
    moved = prefix_hashes(prompt_of(ids, {5: [1, 2, 3], 7: [4, 5, 6]}), BS)
    assert moved[0] == base[0] and moved[1] not in (a[1], base[1])


# --------------------------------------------------------------------------------------------- the engine


def engine_for(talker: HiggsTalker, caching: bool, **options) -> Engine:
    options = {"max_num_seqs": 8, "max_model_len": 512, "block_size": BS, **options}
    config = EngineConfig(prefix_caching=caching, **options)
    return Engine(talker.model, talker.cfg, talker.tokenizer.specials, config)


class _Idle:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine


def spy_prefills(engine: Engine, monkeypatch) -> list:
    """Record every prefill StepBatch the engine's model runner executes."""
    seen, real = [], engine.runner.run

    def run(batch):
        if not batch.is_decode:
            seen.append(batch)
        return real(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    return seen


def run_all(engine: Engine, prompts: list[Prompt], params: list[SamplingParams], at_once: bool = False) -> list:
    """Each prompt's (rows, finish reason, cached tokens): one after another, or all submitted at once."""
    out = []
    if at_once:
        ids = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        while engine.has_unfinished():
            engine.step()
    else:
        ids = []
        for p, s in zip(prompts, params, strict=True):
            ids.append(engine.add_request(p, s))
            while engine.has_unfinished():
                engine.step()
    for rid in ids:
        req = engine.pop_finished(rid)
        out.append((torch.stack(req.rows).long(), req.finish_reason, req.cached_tokens))
    return out


def assert_rows_equal(got: list, want: list) -> None:
    for i, ((rows, reason, _), (want_rows, want_reason, _)) in enumerate(zip(got, want, strict=True)):
        assert reason == want_reason, f"request {i}: {reason} vs {want_reason} without the cache"
        assert torch.equal(rows, want_rows), f"request {i}: rows differ from the engine without the cache"


@pytest.mark.parametrize(
    ("temperature", "text"),
    [
        (0.0, "Hello there, this prompt is long enough to fill several blocks."),
        (1.0, "Hello there, this prompt is long enough to fill several blocks."),
        (1.0, "Hello there, this prompt is long enough to fill whole blocks."),  # 64 tokens: block-aligned
    ],
)
def test_a_repeated_prompt_prefills_only_its_last_block(talker, monkeypatch, temperature, text):
    """A block-aligned prompt still prefills its last block (its last token is sampled from): a lookup that took
    every full block left a prefill of 0 tokens, and the engine failed on it."""
    prompt = talker.build_prompt(text)
    params = [SamplingParams(temperature=temperature, seed=11 + i, max_frames=24) for i in range(3)]
    engine = engine_for(talker, True)
    remember_idle(_Idle(engine))
    prefills = spy_prefills(engine, monkeypatch)
    got = run_all(engine, [prompt] * 3, params)
    want = run_all(engine_for(talker, False), [prompt] * 3, params)
    assert_rows_equal(got, want)
    n = len(prompt)
    hit = (n - 1) // BS * BS  # every full block but the one holding the last token (it is sampled from)
    assert [c for _, _, c in got] == [0, hit, hit]
    assert [b.query_lens for b in prefills] == [[n], [n - hit], [n - hit]]
    assert [b.positions[0] for b in prefills] == [0, hit, hit]
    assert all(b.seq_lens == [n] for b in prefills)
    assert_idle(_Idle(engine))


def common_prefix(a: Prompt, b: Prompt) -> int:
    x, y = a.input_ids.tolist(), b.input_ids.tolist()
    return next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))


def test_prompts_share_only_their_common_full_blocks(talker):
    texts = ["Hello there, how are you today?", "Hello there, how is the weather?", "Hello, something else.",
             "Something else entirely."]  # fmt: skip
    prompts = [talker.build_prompt(t) for t in texts]
    params = [SamplingParams(seed=20 + i, max_frames=20) for i in range(len(texts))]
    engine = engine_for(talker, True)
    got = run_all(engine, prompts, params)
    assert_rows_equal(got, run_all(engine_for(talker, False), prompts, params))
    for i, p in enumerate(prompts):  # the longest full-block prefix any earlier prompt had, short of the last token
        shared = max((common_prefix(p, q) for q in prompts[:i]), default=0)
        assert got[i][2] == min(shared, len(p) - 1) // BS * BS, texts[i]
    assert got[1][2] > 0


def test_another_voice_with_the_same_text_shares_only_the_blocks_before_its_codes(talker):
    gen = torch.Generator().manual_seed(6)
    refs = [torch.randint(0, 1024, (6, talker.cfg.num_codebooks), generator=gen) for _ in range(2)]
    prompts = [talker.build_prompt("Hello world", Reference(r, text="Some reference words")) for r in refs]
    prompts.append(prompts[0])  # the first voice again
    assert torch.equal(prompts[0].input_ids, prompts[1].input_ids)
    first_audio = int(prompts[0].audio_positions.min())
    params = [SamplingParams(seed=3, max_frames=24)] * 3
    engine = engine_for(talker, True)
    got = run_all(engine, prompts, params)
    assert_rows_equal(got, run_all(engine_for(talker, False), prompts, params))
    assert got[1][2] == first_audio // BS * BS  # the second voice's codes start a block of its own
    assert got[2][2] == (len(prompts[0]) - 1) // BS * BS  # the first voice again: all but the last block
    assert not torch.equal(got[0][0], got[1][0])


def test_identical_prompts_admitted_together_compute_their_own_blocks(talker, monkeypatch):
    prompt = talker.build_prompt("Hello there, twice at once.")
    params = [SamplingParams(seed=30 + i, max_frames=16) for i in range(3)]
    engine = engine_for(talker, True)
    prefills = spy_prefills(engine, monkeypatch)
    together = run_all(engine, [prompt] * 2, params[:2], at_once=True)
    later = run_all(engine, [prompt], params[2:])
    assert [c for _, _, c in together + later] == [0, 0, (len(prompt) - 1) // BS * BS]
    assert len(prefills) == 2 and prefills[0].query_lens == [len(prompt)] * 2
    assert engine.scheduler.blocks.num_cached == len(prompt) // BS  # one copy of each full block stays cached
    assert_rows_equal(together + later, run_all(engine_for(talker, False), [prompt] * 3, params))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_pool_too_small_for_the_load_evicts_and_preempts_without_changing_codes(talker, async_scheduling):
    """Repeated prompts through a pool that cannot hold them all: cached blocks are evicted, requests are
    preempted (their prompts found in the cache again on resume), and every row is the cache-free engine's."""
    prompts = [talker.build_prompt(t) for t in LOAD_TEXTS[:3]] * 2
    params = [SamplingParams(temperature=0.9, seed=40 + i, max_frames=30, min_frames=30) for i in range(6)]
    want = run_all(engine_for(talker, False), prompts, params, at_once=True)
    engine = engine_for(talker, True, num_blocks=40, async_scheduling=async_scheduling)
    remember_idle(_Idle(engine))
    ids = [engine.add_request(p, s) for p, s in zip(prompts[:3], params[:3], strict=True)]
    for step in range(2000):
        if step == 12:  # the same prompts again while the first ones run
            ids += [engine.add_request(p, s) for p, s in zip(prompts[3:], params[3:], strict=True)]
        if step > 12 and not engine.has_unfinished():
            break
        engine.step()
        check_block_accounting(engine)
    reqs = [engine.pop_finished(rid) for rid in ids]
    got = [(torch.stack(r.rows).long(), r.finish_reason, r.cached_tokens) for r in reqs]
    assert_rows_equal(got, want)
    assert sum(r.preemptions for r in reqs) > 0, "the pool should have been too small"
    assert sum(r.cached_tokens for r in reqs) > 0, "the repeated prompts should have hit the cache"
    assert_idle(_Idle(engine))


def test_an_evicted_tail_is_recomputed_and_the_head_still_shared(talker, monkeypatch):
    """A, then a long B that needs blocks A's cached prefix holds (its tail goes first), then A again: A finds
    only its head blocks, prefills the rest, and its rows are still the cache-free engine's."""
    a, b = talker.build_prompt(LOAD_TEXTS[1]), talker.build_prompt(LOAD_TEXTS[1][::-1])
    c = talker.cfg.num_codebooks
    pa = SamplingParams(seed=50, max_frames=20, min_frames=20)
    pb = SamplingParams(seed=51, max_frames=60, min_frames=60)
    need_a, need_b = (-(-(len(p) + s.max_frames + c) // BS) for p, s in ((a, pa), (b, pb)))  # blocks at their end
    num_blocks = max(need_a, need_b) + 2
    assert need_b > num_blocks - len(a) // BS, "B must need some of A's cached blocks"
    engine = engine_for(talker, True, num_blocks=num_blocks)
    remember_idle(_Idle(engine))
    got = run_all(engine, [a, b, a], [pa, pb, pa])
    assert_rows_equal(got, run_all(engine_for(talker, False), [a, b, a], [pa, pb, pa]))
    full_hit = (len(a) - 1) // BS * BS
    assert 0 < got[2][2] < full_hit, f"A's head should survive B and its tail not: {got[2][2]} of {full_hit}"
    assert_idle(_Idle(engine))


@pytest.mark.parametrize("short", [0, 1])
def test_admission_takes_the_prompts_blocks_and_room_for_its_first_decode(talker, short):
    """A prompt of k whole blocks is admitted with k + 1 (its first decoded token starts block k + 1); one token
    shorter, with k."""
    ids = talker.build_prompt("Hello there, a prompt cut to whole blocks.").input_ids
    k = len(ids) // BS
    s = engine_for(talker, False).scheduler
    rid = s.add(Prompt(ids[: k * BS - short]), SamplingParams(seed=1, max_frames=4))
    assert s.schedule([]) is not None
    assert len(s.requests[rid].blocks) == k + 1 - short


def check_block_accounting(engine: Engine) -> None:
    """Every held block's reference count is the number of live requests holding it; free + held = all."""
    s = engine.scheduler
    holders: dict[int, int] = {}
    for req in s.running:
        for b in req.blocks:
            holders[b] = holders.get(b, 0) + 1
    for b, n in holders.items():
        assert s.blocks.refs(b) == n, f"block {b}: {s.blocks.refs(b)} references, {n} holders"
    assert s.blocks.num_free + len(holders) == s.blocks.num_blocks


def test_prefix_caching_through_the_api(tiny_dir):
    talker = HiggsTalker.from_pretrained(tiny_dir, prefix_caching=True, max_num_seqs=4, max_model_len=512)
    plain = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=4, max_model_len=512)
    text, sampling = "Hello there, the API caches this prompt.", SamplingParams(seed=9, max_frames=20)
    first, second = (talker.generate(text, sampling) for _ in range(2))
    want = plain.generate(text, sampling)
    assert first.cached_tokens == 0 < second.cached_tokens < second.prompt_tokens
    assert want.cached_tokens == 0
    assert torch.equal(first.rows, want.rows) and torch.equal(second.rows, want.rows)
