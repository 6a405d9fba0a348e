"""Elementwise kernels of the backbone: RMSNorm, fused add + RMSNorm, RoPE, SiLU-and-mul.

``TorchKernels`` is the reference (and the CPU path). ``FlashInferKernels`` calls FlashInfer's fused CUDA
kernels with the same signatures; it is constructed only on CUDA and imports FlashInfer lazily.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cache(head_dim: int, max_positions: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    """cos/sin table for neox-style RoPE: [max_positions, head_dim] fp32 = cat(cos, sin) over head_dim/2."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    t = torch.arange(max_positions, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


class TorchKernels:
    """Plain PyTorch versions; numerics follow transformers' Qwen3 (fp32 accumulation, cast back)."""

    name = "torch"

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x [..., D] -> [..., D] in x.dtype; statistics in fp32."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    @classmethod
    def fused_add_rms_norm(cls, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """(x, residual) [N, D] -> (rms_norm(x + residual), x + residual); out of place."""
        residual = (x.float() + residual.float()).to(x.dtype)
        return cls.rms_norm(residual, weight, eps), residual

    @staticmethod
    def rope(positions: Tensor, q: Tensor, k: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
        """Neox-style rotary embedding. q [N, Hq, D], k [N, Hk, D], positions [N] -> rotated (q, k)."""
        half = cos_sin.shape[-1] // 2
        cs = cos_sin.index_select(0, positions.long())
        cos, sin = cs[:, None, :half], cs[:, None, half:]

        def rotate(x: Tensor) -> Tensor:
            xf = x.float()
            x1, x2 = xf[..., :half], xf[..., half:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

        return rotate(q), rotate(k)

    @staticmethod
    def silu_and_mul(x: Tensor) -> Tensor:
        """x [N, 2I] (gate | up) -> silu(gate) * up [N, I]."""
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


class FlashInferKernels:
    """FlashInfer's fused CUDA kernels (in place where FlashInfer is; callers use the returned tensors)."""

    name = "flashinfer"

    def __init__(self) -> None:
        import flashinfer  # noqa: F401 - fail early and clearly when the gpu extra is missing

        self._fi = flashinfer

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        # 2-D rows, or 3-D per-head (QK-norm); the kernels take row/head strides, so the strided q/k views of
        # the fused qkv output need no copy. The output is a new contiguous tensor.
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self._fi.norm.rmsnorm(x, weight, eps, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))

    def fused_add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        self._fi.norm.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def rope(self, positions: Tensor, q: Tensor, k: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
        n, _, d = q.shape
        q2, k2 = q.reshape(n, -1), k.reshape(n, -1)
        self._fi.rope.apply_rope_with_cos_sin_cache_inplace(positions, q2, k2, d, cos_sin, is_neox=True)
        return q2.view_as(q), k2.view_as(k)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        return self._fi.activation.silu_and_mul(x)


def default_kernels(device: torch.device | str) -> TorchKernels | FlashInferKernels:
    """FlashInfer kernels on CUDA when FlashInfer is installed, else the torch reference."""
    if torch.device(device).type == "cuda":
        try:
            return FlashInferKernels()
        except ImportError:
            pass
    return TorchKernels()
