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


# ULPS: how far the race kernel's scores may lie from torch's: x / T and the subtraction are IEEE in both, but the
# kernel's log(-log(u)) is Triton's fast log twice (a few ulps each), so the two top scores of a row are a near tie
# when they are within 16 ulps of the larger magnitude; a wrong noise index, filter or temperature moves scores by
# O(1), and codes then differ on most rows
ULPS = 16


@pytest.mark.parametrize("b", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_race_kernel_draws_the_reference_codes_on_cuda(b, dtype):
    """``triton_kernels.race_argmax`` against torch's ``race_scores(...).argmax`` on the 4B head's shape: the deploy
    sampling, mixed temperatures / top-k / top-p and greedy rows, 16 steps of noise each. A code may differ only
    where the reference's two best scores are a near tie or its nucleus mass lies within fp32 rounding of
    1 - top_p (``boundary_gap``), and on almost no rows."""
    from higgs_talker.heads import sampling, triton_kernels

    g = torch.Generator(device="cuda").manual_seed(b)
    logits = torch.randn(b, N, V, generator=g, device="cuda") * 3
    logits[:, :, -2:] = float("-inf")
    logits = logits.to(dtype)
    t = cycle([1.0, 1.0, 0.7, 0.0, 1.3], b, device="cuda")
    k = cycle([50, 50, 0, 50, 5], b, device="cuda")
    p = cycle([0.95, 0.9, 0.95, 0.95, 1.0], b, device="cuda")
    checked, differ = 0, []
    for s in range(16):
        seeds, steps = torch.arange(b, device="cuda") * 7919 + 100_003 * s, torch.full((b,), s, device="cuda")
        got = triton_kernels.race_argmax(logits, t, k, p, seeds, steps, sampling.CODE_KEY)
        scores = sampling.race_scores(logits, t, k, p, seeds, steps)
        want = scores.argmax(dim=-1)
        for r, c in (got != want).nonzero().tolist():
            top2 = scores[r, c].topk(2).values.double()
            tie = float(top2[0] - top2[1]) <= ULPS * torch.finfo(torch.float32).eps * float(top2.abs().max())
            row = (logits[r, c].float() / (t[r] if t[r] > 0 else 1.0)).tolist()
            boundary = boundary_gap(row, int(k[r]), float(p[r])) <= BOUNDARY
            differ.append((s, r, c, tie, boundary))
        checked += b * N
    assert all(tie or boundary for *_, tie, boundary in differ), f"codes that differ off a near tie: {differ[:8]}"
    assert len(differ) <= max(1, checked // 1000), f"{len(differ)} of {checked} codes differ"
