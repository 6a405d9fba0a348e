"""Prefill graphs on CPU: the padding rule, and everything around the graph with a stand-in for the capture.

CUDA graphs need a GPU (``tests/test_gpu.py`` replays real ones). Here a stand-in graph runs the captured
function again on each replay, reading the same static tensors, so the rest runs as it does on CUDA: the padded
batch, the static inputs refreshed before each replay, the capture-time check, a bucket that fails to capture,
the engine's routing. The attention is SDPA taught the padded layout (its prefill loops over the requests on the
host, so it could not be captured for real). The reference is the same checkpoint without graphs: the same
rows, sampled and greedy, since padding only adds rows that no real row reads.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from _engine_invariants import engine_rows
from _stand_in_graphs import stand_in_capture

from higgs_talker import HiggsTalker, Reference, SamplingParams
from higgs_talker.attention import SdpaAttention
from higgs_talker.batch import DeviceBatch, StepBatch
from higgs_talker.cuda_graphs import PREFILL_BUCKETS, GraphRunner
from higgs_talker.cuda_graphs import capture as capture_module
from higgs_talker.cuda_graphs import prefill as prefill_graphs
from higgs_talker.cuda_graphs.buckets import normalize_buckets
from higgs_talker.flashinfer_attention import FlashInferAttention
from higgs_talker.ops import TorchKernels

BS = 16
MODES = ("eager", "local_mlp", "full_decode", "auto")


class PaddedSdpa(SdpaAttention):
    """SDPA with the backend side of prefill graphs: FlashInfer's page budget, and a record of each plan."""

    supports_prefill_graphs = True
    prefill_pages = FlashInferAttention.prefill_pages

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.planned: list[tuple[int, int]] = []

    def plan_prefill_bucket(self, batch: StepBatch) -> None:
        pages = sum(-(-n // self.block_size) for n in batch.seq_lens)
        assert pages <= self.prefill_pages(batch.num_tokens, batch.num_reqs), "the bucket's page buffer overflows"
        self.planned.append((batch.num_tokens, batch.num_reqs))
        self.plan(batch)


def graph_talker(tiny_dir, monkeypatch, buckets=(16, 32, 64), capture=stand_in_capture, **options) -> HiggsTalker:
    """The tiny talker with prefill graphs (stand-ins) for ``buckets`` and decode steps on the eager bucket path."""
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024, **options)
    runner = talker.engine.runner
    a = runner.attn
    runner.attn = PaddedSdpa(runner.kv_caches, a.num_heads, a.num_kv_heads, a.head_dim, a.max_model_len,
                             runner.scratch_block)  # fmt: skip
    monkeypatch.setattr(capture_module, "capture_graph", capture)
    graphs = GraphRunner(runner, "auto", (1, 2, 4, 8), 8, prefill_buckets=buckets)
    graphs.prefill = prefill_graphs.PrefillGraphs(runner, graphs.prefill_buckets, pool="no pool on CPU")
    graphs.prefill.capture()
    talker.engine.graphs = graphs
    return talker


def reference_codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1024, (frames, 8), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------- the rule


def _prefill(lens: list[int], first_block: int = 0) -> StepBatch:
    positions, slots, tables, nxt = [], [], [], first_block
    for n in lens:
        blocks = list(range(nxt, nxt + -(-n // BS)))
        nxt += len(blocks)
        tables.append(blocks)
        positions += range(n)
        slots += [blocks[p // BS] * BS + p % BS for p in range(n)]
    ids = [7 + i for i in range(len(positions))]
    return StepBatch(list(range(len(lens))), positions, slots, list(lens), list(lens), tables, token_ids=ids)


@pytest.mark.parametrize("lens", [[5], [13, 3], [20, 12], [1, 1, 1]])
def test_padded_prefill_layout(lens):
    scratch_slot, scratch, dump, tokens, reqs = 8, 40, 41, 32, 9
    batch = _prefill(lens)
    n, r = batch.num_tokens, batch.num_reqs
    padded = batch.padded_prefill(tokens, reqs, scratch_slot, scratch, dump, BS)
    assert padded.num_tokens == tokens and padded.num_reqs == reqs
    assert sum(padded.query_lens) == tokens  # every token belongs to a request (FlashInfer checks q against it)
    # the real part is untouched
    assert padded.positions[:n] == batch.positions and padded.slot_mapping[:n] == batch.slot_mapping
    assert padded.token_ids[:n] == batch.token_ids and padded.block_tables[:r] == batch.block_tables
    # empty requests, then the padding request over the scratch block, writing the dump block
    assert padded.query_lens[r:-1] == padded.seq_lens[r:-1] == [0] * (reqs - r - 1)
    assert padded.block_tables[r:-1] == [[]] * (reqs - r - 1)
    assert padded.query_lens[-1] == padded.seq_lens[-1] == tokens - n
    assert padded.block_tables[-1] == [scratch] * -(-(tokens - n) // BS)
    assert padded.slot_mapping[n:] == [dump * BS] * (tokens - n) and padded.positions[n:] == [0] * (tokens - n)
    assert padded.slots[r:] == [scratch_slot] * (reqs - r)
    # the packed integer inputs: each request samples its own last token; empty ones the last real token
    dev = DeviceBatch.prefill(padded.prefill_packed(), tokens)
    ends = torch.tensor(lens).cumsum(0) - 1
    assert dev.last_token.tolist() == ends.tolist() + [n - 1] * (reqs - r - 1) + [tokens - 1]
    assert dev.token_ids.tolist() == padded.token_ids and dev.positions.tolist() == padded.positions
    assert dev.slots.tolist() == padded.slots and dev.embeds is None and not dev.is_decode


def test_padded_prefill_of_a_full_bucket_has_an_empty_padding_request():
    batch = _prefill([20, 12])
    padded = batch.padded_prefill(32, 4, 8, 40, 41, BS)
    assert padded.query_lens == [20, 12, 0, 0] and padded.block_tables[-1] == []


@pytest.mark.parametrize(
    ("tokens", "reqs", "match"),
    [(16, 9, "a prefill batch of 18 tokens / 2 requests -> 16 / 9"), (32, 2, "-> 32 / 2")],
)
def test_padding_a_prefill_down_is_refused(tokens, reqs, match):
    with pytest.raises(ValueError, match=match):
        _prefill([13, 5]).padded_prefill(tokens, reqs, 8, 40, 41, BS)


def test_padding_a_decode_batch_as_a_prefill_is_refused():
    decode = StepBatch([0], [4], [4], [1], [5], [[0]])
    with pytest.raises(ValueError, match="a decode batch of 1 tokens"):
        decode.padded_prefill(16, 4, 8, 40, 41, BS)


def test_flashinfer_pages_of_empty_requests():
    """FlashInfer's (indptr, indices, last_page_len) of a padded batch: an empty request has no page and a last
    page of 0 (so FlashInfer's ``get_seq_lens`` gives it 0), a full last page is 16, not 0."""
    me = SimpleNamespace(block_size=BS)
    indptr, indices, last = FlashInferAttention._paged(me, [[3], [], [5, 6], [9]], [10, 0, 17, 16])
    assert indptr.tolist() == [0, 1, 1, 3, 4] and indices.tolist() == [3, 5, 6, 9] and last.tolist() == [10, 0, 1, 16]


def test_flashinfer_pages_of_a_large_batch_match_a_plain_loop():
    """64 requests with tables longer than their contexts: the used head of each table, in order."""
    me = SimpleNamespace(block_size=BS)
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 40 * BS, (64,), generator=gen).tolist()
    tables = [torch.randperm(5000, generator=gen)[:40].tolist() for _ in lens]
    indptr, indices, last = FlashInferAttention._paged(me, tables, lens)
    used = [(n + BS - 1) // BS for n in lens]
    assert indices.tolist() == [b for t, u in zip(tables, used, strict=True) for b in t[:u]]
    assert indptr.tolist() == [sum(used[:i]) for i in range(65)]
    assert last.tolist() == [n - max(u - 1, 0) * BS for n, u in zip(lens, used, strict=True)]
    with pytest.raises(ValueError, match="2 block tables for 3 sequence lengths"):
        FlashInferAttention._paged(me, tables[:2], lens[:3])
    with pytest.raises(ValueError):  # a table shorter than its context
        FlashInferAttention._paged(me, [[1]], [2 * BS])


class _StaleWrapper:
    """A stand-in FlashInfer wrapper whose pinned plan buffer holds an earlier owner's bytes (as a reused pinned block
    does), recording how it was made."""

    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs
        self._pin_memory_int_workspace_buffer = torch.full((4096,), 0x11, dtype=torch.uint8)

    def run(self, *args, **kwargs) -> None:
        raise AssertionError("a stand-in wrapper is planned, never run")


def _stand_in_flashinfer(monkeypatch) -> FlashInferAttention:
    """A FlashInferAttention on CPU over a stand-in ``flashinfer`` (wrappers only; plans recorded, not run)."""
    import sys

    from higgs_talker import flashinfer_attention as fa

    fake = SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_StaleWrapper, BatchPrefillWithPagedKVCacheWrapper=_StaleWrapper
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(fa, "WORKSPACE_BYTES", 1024)
    cache = torch.zeros(9, 2, BS, 2, 8)
    attn = FlashInferAttention([cache], 4, 2, 8, 64, scratch_block=8, decode_kernel="native_tc_nosplit", max_batch=4)
    monkeypatch.setattr(attn, "_plan_decode", lambda wrapper, batch, options: None)
    monkeypatch.setattr(attn, "_plan_prefill", lambda wrapper, *args: None)
    return attn


def test_flashinfer_graph_wrappers_start_from_a_zeroed_plan_buffer(monkeypatch):
    """Every wrapper made for a CUDA-graph bucket (decode and prefill) gets its pinned plan buffer zeroed before its
    first plan: FlashInfer's plans write the tile tables of the real CTAs only, and without split-KV nothing masks
    the padded ones, which would read the bytes left there (results/h100_20261206)."""
    attn = _stand_in_flashinfer(monkeypatch)
    decode = StepBatch([0, 0], [5, 9], [5, 25], [1, 1], [6, 10], [[0], [1]])
    attn.plan_bucket(decode)
    wrapper = attn._graph_wrappers[2, "native_tc_nosplit"]
    assert wrapper.kwargs["use_cuda_graph"] and not wrapper._pin_memory_int_workspace_buffer.any()
    prefill = StepBatch([0], list(range(16)), list(range(16)), [16], [16], [[0]])
    attn.plan_prefill_bucket(prefill)
    ((wrapper, _),) = attn._prefill_buckets.values()
    assert wrapper.kwargs["use_cuda_graph"] and not wrapper._pin_memory_int_workspace_buffer.any()
    # the eager wrappers are not CUDA-graph ones: FlashInfer masks nothing there either, but it launches only the
    # CTAs a plan wrote
    assert not attn.decode.kwargs.get("use_cuda_graph") and attn.decode._pin_memory_int_workspace_buffer.all()


# --------------------------------------------------------------------------------------------------- the graphs


def test_prefill_graphs_give_the_rows_of_unpadded_prefills(tiny_dir, talker, monkeypatch):
    t = graph_talker(tiny_dir, monkeypatch)
    graphs, attn = t.engine.graphs, t.engine.runner.attn
    assert graphs.prefill.sizes == (16, 32, 64) and not graphs.prefill.failed
    captured = {size: g.graph for size, g in graphs.prefill.graphs.items()}
    long_text = "a prompt too long for the largest bucket, so it runs unpadded " * 2
    groups = [
        ["short"],
        [t.build_prompt("with reference audio", Reference(reference_codes(9, 1), "reference words"))],
        ["one", "two prompts and", "three in one prefill step"],
        [long_text],
    ]
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_frames=24, seed=11)
    greedy = SamplingParams(temperature=0.0, max_frames=24)
    for group in groups:
        prompts = [p if not isinstance(p, str) else t.build_prompt(p) for p in group]
        tokens = sum(len(p) for p in prompts)
        for params in (sampled, greedy):
            before = {size: g.replays for size, g in captured.items()}
            got = engine_rows(t, prompts, params)
            want = engine_rows(talker, prompts, params)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
            replayed = {size for size, g in captured.items() if g.replays > before[size]}
            size = next((s for s in (16, 32, 64) if s >= tokens), None)
            assert replayed == ({size} if size else set()), f"{tokens} tokens replayed {replayed}"
    assert (64, t.engine.runner.prefill_requests(64)) in attn.planned


def test_a_bucket_that_fails_to_capture_is_left_out_with_one_warning(tiny_dir, talker, monkeypatch, caplog):
    calls = []

    def failing_first(fn, pool=None):  # buckets are captured largest first: this fails bucket 64
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("capture refused")
        return stand_in_capture(fn, pool)

    with caplog.at_level(logging.WARNING):
        t = graph_talker(tiny_dir, monkeypatch, capture=failing_first)
    graphs = t.engine.graphs
    warnings = [r.getMessage() for r in caplog.records if "prefill graph capture failed" in r.getMessage()]
    assert len(warnings) == 1 and "bucket 64" in warnings[0] and "capture refused" in warnings[0]
    assert list(graphs.prefill.failed) == [64] and graphs.prefill.sizes == (16, 32)
    prompt = t.build_prompt("between thirty-two and sixty-four")
    assert 32 < len(prompt) <= 64
    # still padded to bucket 64, as every mode pads it, and run eagerly with the bucket's plan
    assert graphs.prefill_bucket_for(_prefill([len(prompt)])) == 64
    attn = t.engine.runner.attn
    before = len(attn.planned)
    params = SamplingParams(temperature=0.0, max_frames=12)
    assert torch.equal(engine_rows(t, [prompt], params)[0], engine_rows(talker, [prompt], params)[0])
    assert attn.planned[before] == (64, t.engine.runner.prefill_requests(64))


def test_a_step_that_writes_its_embeddings_in_place_still_captures(tiny_dir, talker, monkeypatch):
    """FlashInfer's fused residual add writes the residual in place, and a prefill's first residual is its
    embeddings, the graph's static input: the capture check and each replay must start from freshly written
    embeddings (else every bucket fails its check). Here the torch kernel does the same (exact in fp32)."""

    def add_rms_norm_in_place(cls, x, residual, weight, eps):
        residual.add_(x)
        x.copy_(cls.rms_norm(residual, weight, eps))
        return x, residual

    monkeypatch.setattr(TorchKernels, "fused_add_rms_norm", classmethod(add_rms_norm_in_place))
    t = graph_talker(tiny_dir, monkeypatch)
    graphs = t.engine.graphs
    assert graphs.prefill.sizes == (16, 32, 64) and not graphs.prefill.failed
    prompts = [t.build_prompt(p) for p in ("short", "two prompts and", "three in one prefill step")]
    params = SamplingParams(temperature=0.9, top_p=0.9, max_frames=16, seed=3)
    replays = {size: g.graph.replays for size, g in graphs.prefill.graphs.items()}
    for a, b in zip(engine_rows(t, prompts, params), engine_rows(talker, prompts, params), strict=True):
        assert torch.equal(a, b)
    assert any(g.graph.replays > replays[size] for size, g in graphs.prefill.graphs.items())


def test_a_bucket_holds_the_pages_of_any_context(tiny_dir, monkeypatch):
    """A bucket is chosen by its queries; its page buffers hold a full-length context for every real request (a
    prefix-cache hit reads cached blocks before its query), so only the token count decides."""
    t = graph_talker(tiny_dir, monkeypatch)
    graphs, runner = t.engine.graphs, t.engine.runner
    assert graphs.prefill_bucket_for(_prefill([10, 4], first_block=0)) == 16
    blocks = runner.max_model_len // BS
    longest = StepBatch([0], list(range(1014, 1024)), list(range(10)), [10], [1024], [list(range(blocks))],
                        token_ids=[1] * 10)  # fmt: skip
    assert graphs.prefill_bucket_for(longest) == 16
    assert graphs.prefill_bucket_for(_prefill([40, 30])) is None  # 70 tokens: above every bucket
    # the bucket of the most requests with full contexts: each one's pages fit
    reqs = runner.prefill_requests(16) - 1
    assert reqs * blocks + 1 <= runner.attn.prefill_pages(16, reqs + 1)


def test_prefix_cache_hits_replay_the_prefill_graphs(tiny_dir, talker, monkeypatch):
    """With prefix caching, a prompt seen before prefills only its uncached tail, through the bucket of that tail,
    and gives the rows of the same prompt prefilled whole (sampled and greedy)."""
    t = graph_talker(tiny_dir, monkeypatch, prefix_caching=True)
    graphs = t.engine.graphs
    voice = Reference(reference_codes(40, 4), "the reference words")
    prompts = [t.build_prompt(text, voice) for text in ("first line", "a second, longer line of text")]
    assert all(len(p) > 64 for p in prompts)  # whole, past every bucket: the first prefill runs unpadded
    for params in (SamplingParams(temperature=0.9, top_p=0.9, max_frames=16, seed=5),
                   SamplingParams(temperature=0.0, max_frames=16)):  # fmt: skip
        engine_rows(t, prompts[:1], params)  # the voice's blocks are cached now
        replays = {size: g.graph.replays for size, g in graphs.prefill.graphs.items()}
        rid = t.engine.add_request(prompts[1], params)
        while t.engine.has_unfinished():
            t.engine.step()
        req = t.engine.pop_finished(rid)
        assert req.cached_tokens >= BS and len(prompts[1]) - req.cached_tokens <= 64  # the tail fits a bucket
        assert torch.equal(torch.stack(req.rows).long(), engine_rows(talker, prompts[1:], params)[0])
        assert any(g.graph.replays > replays[size] for size, g in graphs.prefill.graphs.items())


def test_prefill_buckets_default_where_a_prefill_can_replay(tiny_dir):
    t = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024)
    runner = t.engine.runner
    # SDPA cannot replay a prefill: the default buckets, or any asked for, are dropped there
    assert GraphRunner(runner, "auto", (1, 2), 8).prefill_buckets == ()
    assert GraphRunner(runner, "auto", (1, 2), 8, prefill_buckets=PREFILL_BUCKETS).prefill_buckets == ()
    # with a backend that can: every mode pads prefills to them (PREFILL_BUCKETS unless asked otherwise; ()
    # turns them off); only the modes that graph whole steps capture them
    a = runner.attn
    runner.attn = PaddedSdpa(runner.kv_caches, a.num_heads, a.num_kv_heads, a.head_dim, a.max_model_len,
                             runner.scratch_block)  # fmt: skip
    assert all(GraphRunner(runner, m, (1, 2), 8).prefill_buckets == PREFILL_BUCKETS for m in MODES)
    assert all(GraphRunner(runner, m, (1, 2), 8, prefill_buckets=(32, 16)).prefill_buckets == (16, 32) for m in MODES)
    assert [m for m in MODES if GraphRunner(runner, m, (1, 2), 8).decision.full_prefill] == ["full_decode", "auto"]
    assert GraphRunner(runner, "auto", (1, 2), 8, prefill_buckets=()).prefill_buckets == ()
    assert normalize_buckets(PREFILL_BUCKETS) == PREFILL_BUCKETS  # sorted, distinct, positive
