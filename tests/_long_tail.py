"""Long-tailed codebook logits and a float64 reference of vLLM's top-k / top-p rule, for the sampling tests.

A talker's code distributions are usually a few likely codes and a long tail of codes with probabilities
from about 1e-6 down to 1e-17. A top-p rule evaluated on an fp32 running sum near 1 cannot see that tail;
the tests here use such rows to find out whether it does.
"""

from __future__ import annotations

import math

import torch
from _tolerance import chain_rel_tol
from torch import Tensor

V = 1026  # the talker's codebook size (1024 codes, BOC, EOC)
NO_NUCLEUS = [1.0, 1.5, math.inf, math.nan]  # NaN reads as 1 (SPEC 4.6), and so does anything above 1
NO_TOP_K = [0, -1, V, V + 7]
# fp32 cumulative masses of the filter against the exact ones: an fp32 softmax (a V-term sum, exp, division)
# and a V-term prefix sum of positive terms (any order), each a relative error; twice that covers 1 - p rounded
# to fp32. Rows with a mass this close to 1 - p may go either way.
BOUNDARY = 2 * chain_rel_tol([V, V], 8, torch.float32)


def cycle(values, n: int, period: int = 1, device: str = "cpu") -> Tensor:
    """values repeated to length n, each held ``period`` times in a row."""
    return torch.tensor(values)[torch.arange(n) // period % len(values)].to(device)


def long_tailed_logits(rows: int, seed: int, v: int = V, heads: int = 4, device: str = "cpu") -> Tensor:
    """fp32 logits [rows, v]: ``heads`` likely codes near 0, the rest 14 to 38 below (probabilities about
    1e-6 to 1e-17), and two codes per row at -inf (as the delay mask leaves BOC / EOC)."""
    g = torch.Generator().manual_seed(seed)
    x = -(torch.rand(rows, v, generator=g) * 24 + 14)
    top = torch.rand(rows, v, generator=g).argsort(dim=1)  # a random permutation per row
    x.scatter_(1, top[:, :heads], torch.randn(rows, heads, generator=g) * 1.5)
    x.scatter_(1, top[:, heads : heads + 2], float("-inf"))
    return x.to(device)


def reference_keep(row: list[float], k: int, p: float) -> list[bool]:
    """Which codes of one logit row vLLM's ``apply_top_k_top_p`` keeps, in float64 from the exact softmax.

    Top-k: keep every code at or above the k-th largest logit (k <= 0 or >= len(row): off). Top-p on the
    survivors, renormalised: sort them from least to most likely, and drop each code whose cumulative mass
    (itself and every less likely survivor) is at most 1 - p; the most likely code always stays. p >= 1 or NaN:
    no nucleus (vLLM's kernels skip such rows; ``1 - p <= 0`` would only drop codes of probability 0).
    Among equal logits the lower index counts as more likely (the stable order ``top_k_top_p_filter`` uses).
    """
    v = len(row)
    k = k if 0 < k < v else v
    kth = sorted(row, reverse=True)[k - 1]
    keep = [x >= kth and x != -math.inf for x in row]
    if not p < 1:
        return keep
    mx = max(x for x, kept in zip(row, keep, strict=True) if kept)
    weights = [math.exp(x - mx) if kept else 0.0 for x, kept in zip(row, keep, strict=True)]
    z = math.fsum(weights)
    ascending = sorted(range(v), key=lambda i: (row[i], -i))  # least likely first; ties: higher index first
    cum = 0.0
    for rank, i in enumerate(ascending):
        cum += weights[i] / z
        if keep[i] and cum <= 1 - p and rank < v - 1:
            keep[i] = False
    return keep


def boundary_gap(row: list[float], k: int, p: float) -> float:
    """How close (relatively) any survivor's cumulative mass in ``reference_keep`` lies to 1 - p: rows where
    this is within fp32 rounding may go either way in fp32 arithmetic. inf where the nucleus is off."""
    if not p < 1:
        return math.inf
    v = len(row)
    k = k if 0 < k < v else v
    kth = sorted(row, reverse=True)[k - 1]
    kept = [x for x in row if x >= kth and x != -math.inf]
    mx = max(kept)
    w = sorted(math.exp(x - mx) for x in kept)
    z, cum, gap = math.fsum(w), 0.0, math.inf
    for wi in w:
        cum += wi / z
        gap = min(gap, abs(cum - (1 - p)) / max(cum, 1 - p))
    return gap
