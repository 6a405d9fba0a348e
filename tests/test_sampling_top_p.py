"""The top-p rule on long-tailed code distributions (SPEC 4.6): ``top_p >= 1`` (or NaN) is no nucleus at all, so
the ``filter=False`` shortcut is exact; ``top_p < 1`` keeps what vLLM's ``apply_top_k_top_p`` keeps, checked
against a float64 reference of its rule; rows of a mixed batch get what they get alone."""

from __future__ import annotations

import pytest
import torch
from _long_tail import BOUNDARY, NO_NUCLEUS, NO_TOP_K, V, boundary_gap, cycle, long_tailed_logits, reference_keep

from higgs_talker.heads import sampling
from higgs_talker.heads.sampling import race_scores, sample_codes, top_k_top_p_filter

N = 8
NAN = float("nan")


def _lost(out: torch.Tensor, x: torch.Tensor) -> str:
    lost = x.isfinite() & ~out.isfinite()
    return f"{int(lost.sum())} finite codes in {int(lost.any(-1).sum())} rows were filtered out"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_top_p_of_one_or_more_keeps_every_code(dtype):
    """Every (top_p >= 1 or NaN) x (top_k off) pair: the filter returns the logits unchanged, and the race's
    scores with the filter equal those without it (every finite code stays finite)."""
    rows = 512
    x = long_tailed_logits(rows, seed=1).to(dtype).float()
    top_p, top_k = cycle(NO_NUCLEUS, rows), cycle(NO_TOP_K, rows, period=len(NO_NUCLEUS))
    out = top_k_top_p_filter(x, top_k, top_p)
    assert torch.equal(out, x), _lost(out, x)

    b = rows // N
    logits = x.to(dtype).view(b, N, V)
    t = cycle([1.0, 0.7, 1.3, 2.0], b)
    p, k = cycle(NO_NUCLEUS, b), cycle(NO_TOP_K, b, period=len(NO_NUCLEUS))
    seeds, steps = torch.arange(b) * 7919 + 5, torch.arange(b) + 3
    filtered = race_scores(logits, t, k, p, seeds, steps, filter=True)
    assert torch.equal(filtered.isfinite(), logits.isfinite()), _lost(filtered, logits)
    assert torch.equal(filtered, race_scores(logits, t, k, p, seeds, steps, filter=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_filter_shortcut_gives_the_same_codes(dtype, monkeypatch):
    """``sample_codes(filter=True)`` equals ``filter=False`` when no row has a filter on: over many seeds, and
    under noise that hands the race to each row's least likely codes (the hashed noise reaches a code of
    probability 1e-9 too rarely for a test to see it)."""
    b = 64
    logits = long_tailed_logits(b * N, seed=2).to(dtype).view(b, N, V)
    t = cycle([1.0, 0.7, 1.3, 2.0], b)
    p, k = cycle(NO_NUCLEUS, b), cycle(NO_TOP_K, b, period=len(NO_NUCLEUS))

    def both(seeds, steps):
        on = sample_codes(logits, t, k, p, seeds, steps, filter=True)
        return on, sample_codes(logits, t, k, p, seeds, steps, filter=False)

    for s in range(32):
        on, off = both(torch.arange(b) + 1000 * s, torch.full((b,), s))
        assert torch.equal(on, off), f"seed block {s}: {int((on != off).sum())} codes differ"

    x = logits.float() / t[:, None, None]
    gap = x.amax(dim=-1, keepdim=True) - x  # >= 0; inf at masked codes

    def tail_favoured(seeds, steps, n, v):
        """E = exp(-1.25 gap): a code scores x + 1.25 gap = 1.25 max - 0.25 x, so the least likely code wins."""
        return torch.exp(-1.25 * gap)

    monkeypatch.setattr(sampling, "exponential_noise", tail_favoured)
    on, off = both(torch.arange(b), torch.zeros(b, dtype=torch.long))
    deepest = gap.masked_fill(gap.isinf(), 0).amax(dim=-1)
    assert (gap.gather(2, off[..., None])[..., 0] > deepest - 0.01).all()  # the race did pick each row's last code
    assert torch.equal(on, off), f"{int((on != off).sum())} of {on.numel()} codes differ"


def test_mixed_batch_rows_get_what_they_get_alone():
    """A batch mixing no filter, nucleus only, top-k only and both: each request's scores equal its scores
    alone, and each codebook row keeps the codes the float64 reference keeps."""
    kinds = [(1.0, 0), (0.9, 0), (1.0, 50), (0.95, 20), (0.999999, 0), (1.0, V), (0.99, 300), (NAN, -1)]
    b = 2 * len(kinds)
    logits = long_tailed_logits(b * N, seed=3).view(b, N, V)
    p = torch.tensor([kinds[i % len(kinds)][0] for i in range(b)])
    k = torch.tensor([kinds[i % len(kinds)][1] for i in range(b)])
    t = cycle([1.0, 0.8, 1.7], b)
    seeds, steps = torch.arange(b) * 31 + 1, torch.arange(b) * 5
    batch = race_scores(logits, t, k, p, seeds, steps)
    x = logits / t[:, None, None]
    checked = 0
    for i in range(b):
        one = slice(i, i + 1)
        alone = race_scores(logits[one], t[one], k[one], p[one], seeds[one], steps[one])
        assert torch.equal(batch[i], alone[0]), f"request {i} (top_p={p[i]}, top_k={k[i]}) differs alone"
        for c in range(N):
            row, ki, pi = x[i, c].tolist(), int(k[i]), float(p[i])
            if boundary_gap(row, ki, pi) <= BOUNDARY:
                continue
            assert batch[i, c].isfinite().tolist() == reference_keep(row, ki, pi), (i, c, pi, ki)
            checked += 1
    assert checked >= 0.9 * b * N


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nucleus_keeps_what_vllm_keeps(dtype):
    """top_p from 0.5 to 0.999999 (and some rows with top-k too) on long-tailed rows: the filter keeps exactly
    the codes of vLLM's rule computed in float64 (the cumulative mass from the least likely code up, against
    1 - p), except in rows where a mass sits within fp32 rounding of 1 - p."""
    m = 512
    x = long_tailed_logits(m, seed=4).to(dtype).float()
    top_p = cycle([0.999999, 0.99999, 0.9999, 0.999, 0.99, 0.95, 0.9, 0.5], m)
    top_k = torch.where(torch.arange(m) % 3 == 0, 600, 0)
    out = top_k_top_p_filter(x, top_k, top_p)
    kept = out.isfinite()
    assert torch.equal(out[kept], x[kept])  # survivors keep their logits
    checked, wrong = 0, []
    for i in range(m):
        row, k, p = x[i].tolist(), int(top_k[i]), float(top_p[i])
        if boundary_gap(row, k, p) <= BOUNDARY:
            continue
        want = torch.tensor(reference_keep(row, k, p))
        if not torch.equal(kept[i], want):
            wrong.append((i, p, int((kept[i] != want).sum())))
        checked += 1
    assert not wrong, f"{len(wrong)} rows keep other codes than vLLM's rule (row, top_p, codes): {wrong[:8]}"
    assert checked >= 0.9 * m


def test_a_code_whose_tail_mass_is_exactly_one_minus_p_is_dropped():
    """The nucleus rule at its edge (vLLM's: drop while the tail mass is at most 1 - p), on masses fp32 holds exactly:
    four equal codes (0.25 each) under top_p 0.5 keep two, the tail of two weighing exactly 0.5 (``<=``, not ``<``).
    Which two of the equal codes stay is our stable order's choice (the lower indices), not vLLM's."""
    kept = torch.isfinite(top_k_top_p_filter(torch.zeros(1, 4), torch.tensor([0]), torch.tensor([0.5])))
    assert kept.tolist() == [[True, True, False, False]]  # the stable order: the lower indices count as likelier
