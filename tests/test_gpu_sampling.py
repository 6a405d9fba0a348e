"""CUDA: the top-p rule on long-tailed code distributions, eagerly and replayed in a CUDA graph (SPEC 4.6).

CUDA's cumsum adds in fp32, so a running sum from the most likely code down reaches 1.0 well before a long
tail ends; the filter sums from the least likely code up (vLLM's rule), and top_p >= 1 filters nothing.
"""

from __future__ import annotations

import pytest
import torch
from _long_tail import BOUNDARY, NO_NUCLEUS, NO_TOP_K, V, boundary_gap, cycle, long_tailed_logits, reference_keep

from higgs_talker.cuda_graphs.capture import capture_graph
from higgs_talker.heads.sampling import race_scores, sample_codes, top_k_top_p_filter

pytestmark = pytest.mark.gpu

N = 8


def _request_params(b: int, top_p, top_k) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, seeds, steps) [b] each on CUDA."""
    t = cycle([1.0, 0.7, 1.3, 2.0], b, device="cuda")
    seeds = torch.arange(b, device="cuda") * 7919 + 5
    return t, cycle(top_k, b, device="cuda"), cycle(top_p, b, device="cuda"), seeds, torch.arange(b, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_top_p_of_one_or_more_keeps_every_code_on_cuda(dtype):
    b = 128
    logits = long_tailed_logits(b * N, seed=11, device="cuda").to(dtype).view(b, N, V)
    t, k, p, seeds, steps = _request_params(b, NO_NUCLEUS, [k for k in NO_TOP_K for _ in NO_NUCLEUS])
    on = race_scores(logits, t, k, p, seeds, steps, filter=True)
    lost = logits.isfinite() & ~on.isfinite()
    assert not lost.any(), f"{int(lost.sum())} finite codes were filtered out"
    assert torch.equal(on, race_scores(logits, t, k, p, seeds, steps, filter=False))
    for s in range(16):
        seeds_s = seeds + 100_003 * s
        a = sample_codes(logits, t, k, p, seeds_s, steps, filter=True)
        assert torch.equal(a, sample_codes(logits, t, k, p, seeds_s, steps, filter=False))


def test_nucleus_keeps_what_vllm_keeps_on_cuda():
    m = 512
    x = long_tailed_logits(m, seed=12, device="cuda")
    top_p = cycle([0.999999, 0.99999, 0.9999, 0.999, 0.99, 0.95, 0.9, 0.5], m, device="cuda")
    top_k = torch.where(torch.arange(m, device="cuda") % 3 == 0, 600, 0)
    kept = top_k_top_p_filter(x, top_k, top_p).isfinite().cpu()
    x, top_k, top_p = x.cpu(), top_k.cpu(), top_p.cpu()
    checked, wrong = 0, []
    for i in range(m):
        row, k, p = x[i].tolist(), int(top_k[i]), float(top_p[i])
        if boundary_gap(row, k, p) <= BOUNDARY:
            continue
        if kept[i].tolist() != reference_keep(row, k, p):
            wrong.append((i, p))
        checked += 1
    assert not wrong, f"{len(wrong)} rows keep other codes than vLLM's rule (row, top_p): {wrong[:8]}"
    assert checked >= 0.9 * m


@torch.inference_mode()
def test_the_filter_in_a_cuda_graph_follows_each_replays_top_p():
    """One captured race serves every top_p: replays with a mixed batch (nucleus on, off, top-k) and then with
    every nucleus off equal the eager scores, and the rows with top_p >= 1 keep every code."""
    b = 64
    logits = long_tailed_logits(b * N, seed=13, device="cuda").view(b, N, V)
    t, k, p, seeds, steps = _request_params(b, [0.9], [0])
    graph, out = capture_graph(lambda: race_scores(logits, t, k, p, seeds, steps))
    cases = {
        "mixed": ([1.0, 0.9, 0.999999, float("nan"), 1.0, 0.5], [0, 0, 0, V, 40, 40]),
        "no nucleus": (NO_NUCLEUS, [0, -1, V]),
    }
    for name, (top_p, top_k) in cases.items():
        p.copy_(cycle(top_p, b, device="cuda"))
        k.copy_(cycle(top_k, b, device="cuda"))
        graph.replay()
        assert torch.equal(out, race_scores(logits, t, k, p, seeds, steps)), name
        free = ~(p < 1) & ((k <= 0) | (k >= V))
        assert torch.equal(out[free].isfinite(), logits[free].isfinite()), name
    assert torch.equal(out, race_scores(logits, t, k, p, seeds, steps, filter=False))
