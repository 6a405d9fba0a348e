"""Test tolerances derived from the dtype and the reduction length, never tuned to what passed once.

Two error models, both standard (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.):

- Accumulation. A dot product of length K summed in a format with unit roundoff u satisfies
  ``|fl(a.b) - a.b| <= gamma_K * (|a|.|b|)`` with ``gamma_K = K u / (1 - K u)`` (Lemma 3.1, Eq. 3.5), for any
  summation order. Two evaluations of the same product (one gathered row against the full matmul, a blocked
  against an unblocked kernel) therefore differ by at most ``2 gamma_K (|a|.|b|)`` elementwise: a rigorous
  bound (``matmul_bound``).
- A chain of operations (a network). Relative errors of successive steps add to first order, so the output's
  relative error is bounded by the sum of the steps' bounds: ``gamma_K`` for each reduction of length K in the
  accumulation dtype, plus ``u`` for each rounding of a stored intermediate to the storage dtype
  (``chain_rel_tol``). This is a first-order worst case for well-conditioned layers (normalised activations,
  weights scaled by 1/sqrt(fan_in), as every test model here has); it is not a proof for arbitrary inputs.

A real defect (a wrong mask, rotation, scale or index) moves results by O(1) relatively, orders of magnitude
above these bounds, so deriving them costs the tests no sensitivity.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding one real number to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def gamma(k: int, dtype: torch.dtype) -> float:
    """Higham's gamma_K = K u / (1 - K u) for K >= 1 terms accumulated in ``dtype``."""
    ku = k * unit_roundoff(dtype)
    assert ku < 1, f"gamma_{k} is unbounded in {dtype}"
    return ku / (1 - ku)


def matmul_bound(a: Tensor, b: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Elementwise bound [M, N] on the difference of two evaluations of ``a [M, K] @ b [N, K].T`` in ``dtype``
    (default: a's dtype): ``2 gamma_K (|a| @ |b|.T)``, computed in float64."""
    k = a.shape[-1]
    mag = a.double().abs() @ b.double().abs().T
    return 2 * gamma(k, dtype or a.dtype) * mag


def assert_matmul_close(got: Tensor, want: Tensor, a: Tensor, b: Tensor, dtype: torch.dtype | None = None) -> None:
    """Assert two evaluations of ``a @ b.T`` agree within ``matmul_bound`` everywhere."""
    bound = matmul_bound(a, b, dtype)
    diff = (got.double() - want.double()).abs()
    worst = (diff - bound).max().item()
    assert worst <= 0, f"matmul results differ by up to {diff.max().item():.3g}, beyond the rounding bound"


def chain_rel_tol(
    reductions: Iterable[int], roundings: int, accumulate: torch.dtype, store: torch.dtype | None = None
) -> float:
    """First-order relative error bound of a chain: ``sum(gamma_K)`` over its reductions accumulated in
    ``accumulate`` plus ``roundings * u`` for intermediates stored in ``store`` (default ``accumulate``)."""
    store = store or accumulate
    return sum(gamma(k, accumulate) for k in reductions) + roundings * unit_roundoff(store)


def rel_err(got: Tensor, want: Tensor) -> float:
    """Norm-wise relative error ``|got - want| / |want|`` in float64."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def sum_bound(terms: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """Elementwise bound on the difference of two evaluations of ``terms.sum(dim)`` in ``dtype`` (default: the
    terms' dtype): ``2 gamma_K sum|terms|`` with ``K = terms.shape[dim]`` (a sum is a dot product with ones, so
    Eq. 3.5 applies, in any summation order), computed in float64."""
    k = terms.shape[dim]
    return 2 * gamma(k, dtype or terms.dtype) * terms.double().abs().sum(dim)


def assert_within(got: Tensor, want: Tensor, bound: Tensor, what: str = "results") -> None:
    """Assert ``|got - want| <= bound`` everywhere (float64)."""
    diff = (got.double() - want.double()).abs()
    worst = (diff - bound).max().item()
    assert worst <= 0, f"{what} differ by up to {diff.max().item():.3g}, beyond the rounding bound"


def kernel_rel_tol(
    store: torch.dtype,
    roundings: int = 1,
    reductions: Iterable[int] = (),
    ops: int = 0,
    accumulate: torch.dtype = torch.float32,
) -> float:
    """Norm-wise relative error bound of a fused low-precision kernel against a reference evaluated in
    ``accumulate`` on the same inputs (already rounded to ``store``) and left unrounded.

    The kernel computes in ``accumulate`` and rounds its result ``roundings`` times to ``store``: ``roundings *
    u_store``. Both sides then differ from the exact result by their own accumulate-dtype error,
    ``chain_rel_tol(reductions, ops, accumulate)`` each: gamma_K per reduction of length K, ``u`` per
    elementwise operation (count an approximate intrinsic such as ``rsqrt.approx`` as the few ``u`` its
    documented error is). Where every element's relative error is within a bound, so is the norm-wise
    ``rel_err``: ``|got_i - want_i| <= e |want_i|`` for all i gives ``||got - want|| <= e ||want||``.
    First order, like ``chain_rel_tol``.
    """
    return roundings * unit_roundoff(store) + 2 * chain_rel_tol(reductions, ops, accumulate)


def qwen3_chain(
    hidden: int, heads: int, head_dim: int, intermediate: int, layers: int, context: int
) -> tuple[list[int], int]:
    """The reductions (their lengths) and stored roundings of one forward pass of a Qwen3 decoder.

    Per layer: RMSNorm (K = hidden), q/k/v (hidden), QK-norm (head_dim), scores (head_dim), softmax sum and
    P @ V (context), o_proj (q_size), RMSNorm (hidden), gate/up (hidden), down (intermediate); the final
    RMSNorm. Stored roundings per layer: norm, q/k/v, QK-norm, RoPE, attention, o_proj, residual, norm,
    gate/up, SiLU-mul, down, residual (12), plus the final norm's.
    """
    per_layer = [hidden, hidden, head_dim, head_dim, context, context, heads * head_dim]
    per_layer += [hidden, hidden, intermediate]
    return per_layer * layers + [hidden], 12 * layers + 1
