"""Full-decode graphs' sampler variants on CPU, with a stand-in for the capture (``_stand_in_graphs``).

Each bucket has the graph of the whole sampler and two cheaper ones: for batches without top-k / top-p and for
all-greedy batches. A batch must replay the cheapest graph its sampling allows and get the rows of the eager
sampler with its own shortcuts (the same checkpoint without graphs is the reference).
"""

from __future__ import annotations

import pytest
import torch
from _stand_in_graphs import stand_in_capture

from higgs_talker import HiggsTalker, SamplingParams
from higgs_talker.cuda_graphs import GraphRunner
from higgs_talker.cuda_graphs import capture as capture_module
from higgs_talker.cuda_graphs import full_decode as full_graphs

BUCKETS = (1, 2, 4, 8)


def variant_talker(tiny_dir, monkeypatch, capture=stand_in_capture) -> HiggsTalker:
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024)
    monkeypatch.setattr(capture_module, "capture_graph", capture)
    graphs = GraphRunner(talker.engine.runner, "full_decode", BUCKETS, 8)
    graphs.full = full_graphs.FullDecodeGraphs(talker.engine.runner, graphs.buckets, pool="no pool on CPU")
    graphs.full.capture()
    talker.engine.graphs = graphs
    return talker


def replays(talker: HiggsTalker) -> dict:
    full = talker.engine.graphs.full
    out = {(size, True, True): g.graph.replays for size, g in full.graphs.items()}
    return out | {key: g.graph.replays for key, g in full.variants.items()}


PARAMS = {
    "greedy": [SamplingParams(temperature=0.0, max_frames=20)] * 3,
    "temperature": [SamplingParams(temperature=0.9, seed=i, max_frames=20) for i in range(3)],
    "top-k": [SamplingParams(temperature=0.9, top_k=5, seed=i, max_frames=20) for i in range(3)],
    "mixed": [SamplingParams(temperature=0.0, max_frames=20), SamplingParams(temperature=0.7, seed=3, max_frames=20),
              SamplingParams(temperature=1.0, top_p=0.8, seed=4, max_frames=20)],
}  # fmt: skip
# the graph each batch may use: (draw, filter) of the cheapest sampler that serves it
EXPECTED = {"greedy": (False, False), "temperature": (True, False), "top-k": (True, True), "mixed": (True, True)}


@pytest.mark.parametrize("case", list(PARAMS))
def test_a_batch_replays_the_cheapest_variant_it_allows_with_the_eager_rows(tiny_dir, talker, monkeypatch, case):
    t = variant_talker(tiny_dir, monkeypatch)
    full = t.engine.graphs.full
    assert sorted(full.graphs) == list(BUCKETS) and not full.failed and not full.failed_variants
    assert sorted(full.variants) == sorted((s, d, f) for s in BUCKETS for d, f in full_graphs.SAMPLER_VARIANTS)
    texts = ["one request", "a second one", "and a third, longer request"]
    before = replays(t)
    got = [r.rows for r in t.generate(texts, PARAMS[case])]
    want = [r.rows for r in talker.generate(texts, PARAMS[case])]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    used = {key for key, n in replays(t).items() if n > before[key]}
    assert used and {key[1:] for key in used} == {EXPECTED[case]}, used


def test_a_variant_that_fails_to_capture_leaves_its_batches_on_the_whole_sampler(tiny_dir, talker, monkeypatch):
    calls = []

    def failing_greedy(fn, pool=None):  # captures: 4 whole-sampler graphs, 4 no-filter, then 4 greedy ones
        calls.append(1)
        if len(calls) > 8:
            raise RuntimeError("greedy capture refused")
        return stand_in_capture(fn, pool)

    t = variant_talker(tiny_dir, monkeypatch, capture=failing_greedy)
    full = t.engine.graphs.full
    assert sorted(full.failed_variants) == [(s, False, False) for s in BUCKETS]
    before = replays(t)
    params = PARAMS["greedy"]
    got = [r.rows for r in t.generate(["one request", "another"], params[:2])]
    want = [r.rows for r in talker.generate(["one request", "another"], params[:2])]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    used = {key for key, n in replays(t).items() if n > before[key]}
    assert used and all(key[1:] == (True, True) for key in used)
