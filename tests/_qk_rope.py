"""The fused QK-norm + RoPE + K/V-write kernel (``triton_ops``) against the torch reference, on any device: the
GPU tests run it compiled, the CPU tests under the Triton interpreter.

The bound is elementwise. The kernel rounds the normed head n to the storage dtype, rotates it in fp32 and rounds
the result: the first rounding moves each of a rotated pair's inputs by at most u |n|, and a rotation with
|cos|, |sin| <= 1 carries that into y_i as at most u (|n_i| + |n_partner|); the final rounding adds u |y_i|, which
is no larger. So |got - want| <= kernel_rel_tol(dtype, 2, [D], ops) * (|n_i| + |n_partner|), where ``want`` is the
reference in fp32 on the same (already rounded) inputs, left unrounded, and ``ops`` counts both sides' fp32
operations. A wrong position, head, half or row is off by O(1) of that magnitude.
"""

from __future__ import annotations

import torch
from _tolerance import assert_within, kernel_rel_tol

from higgs_talker.ops import TorchKernels, rope_cache

# RMSNorm: sum of squares (gamma_D), / D, + eps, rsqrt (rsqrt.approx.f32: under 3 fp32 u), x * r, * w; RoPE: two
# products and a sum per output, 3 sqrt(2) u norm-wise < 5 u (the counts of test_gpu.py's NORM_OPS + ROPE_OPS)
FUSED_OPS = 4 + 3 + 5
MAX_POSITIONS = 32768


def heads_for(head_dim: int) -> tuple[int, int]:
    """(Hq, Hk): the 4B talker's 32/8 at head_dim 128, the medium test model's 8/2 otherwise."""
    return (32, 8) if head_dim == 128 else (8, 2)


def check_qk_norm_rope_store(
    fused, device: str, dtype: torch.dtype, head_dim: int, n: int, seed: int = 0, roundings: int = 2,
    heads: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """Run ``fused`` (``triton_ops.qk_norm_rope_store``'s signature) on a row-strided qkv view with random positions
    below 32k and distinct random cache rows; check Q and the cached K within the bound, V exact, every other cache
    row untouched. ``roundings``: rounding steps of size u (2: the kernel's two; the interpreter truncates, 4)."""
    hq, hk = heads or heads_for(head_dim)
    d, width = head_dim, (hq + 2 * hk) * head_dim
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    qkv = randn(n, width + 3 * d)[:, d : d + width]  # row stride width + 3 D: a strided view
    positions = torch.randint(0, MAX_POSITIONS, (n,), generator=g, device=device)
    q_weight, k_weight = (1 + 0.1 * randn(d)).to(dtype), (1 + 0.1 * randn(d)).to(dtype)
    eps = 1e-6
    cos_sin = rope_cache(d, MAX_POSITIONS, 1e6, device)
    cache = randn(2 * n + 7, hk, d)  # 7 rows nobody addresses
    kv_rows = torch.randperm(cache.shape[0], generator=g, device=device)[: 2 * n].view(2, n)
    before = cache.clone()

    q = fused(qkv, positions, q_weight, k_weight, eps, cos_sin, cache, kv_rows)

    ref_cache = before.float()
    want_q = TorchKernels.qk_norm_rope_store(
        qkv.float(), positions, q_weight.float(), k_weight.float(), eps, cos_sin, ref_cache, kv_rows
    )
    tol = kernel_rel_tol(dtype, roundings, [d], FUSED_OPS)
    q_in, k_in, v_in = qkv.float().split([hq * d, hk * d, hk * d], dim=-1)
    for name, got, want, x, w in (
        ("q", q, want_q, q_in.reshape(n, hq, d), q_weight),
        ("k", cache[kv_rows[0]], ref_cache[kv_rows[0]], k_in.reshape(n, hk, d), k_weight),
    ):
        normed = TorchKernels.rms_norm(x, w.float(), eps).abs()
        half = normed[..., : d // 2] + normed[..., d // 2 :]  # |n_i| + |n_partner|
        assert got.shape == want.shape and got.dtype == dtype, (name, got.shape, got.dtype)
        assert_within(got, want, tol * torch.cat([half, half], dim=-1), f"{name} ({dtype}, D={d}, N={n})")
    assert torch.equal(cache[kv_rows[1]], v_in.reshape(n, hk, d).to(dtype)), "V rows differ from the qkv input"
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device=device)
    untouched[kv_rows.flatten()] = False
    assert torch.equal(cache[untouched], before[untouched]), "rows no token addresses were written"
