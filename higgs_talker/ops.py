"""Kernels of the backbone besides attention: RMSNorm, fused add + RMSNorm, RoPE, SiLU-and-mul, QK-norm + RoPE +
K/V cache writes in one, and the linears.

``TorchKernels`` is the reference (and the CPU path). ``FlashInferKernels`` calls FlashInfer's fused CUDA
kernels with the same signatures, our Triton kernel (``triton_ops``) for the QK-norm + RoPE + K/V writes, and
for inputs of one row and of a few rows our Triton linears (``triton_gemv``) on the linears where warm-up measured
them faster than cuBLAS (``row_configs``, ``few_row_configs``); it is constructed only on CUDA and imports
FlashInfer and triton lazily.

The attention layer calls ``qk_norm_rope_store`` only where ``can_fuse_qk_rope(head_dim)`` holds and the
step's attention backend gives a K/V destination (``kv_destination``); otherwise it runs the separate steps.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def rope_cache(head_dim: int, max_positions: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    """cos/sin table for neox-style RoPE: [max_positions, head_dim] fp32 = cat(cos, sin) over head_dim/2."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    t = torch.arange(max_positions, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def qk_norm_rope(
    kernels, qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos_sin: Tensor,
    num_kv_heads: int, head_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The separate steps the fused kernel replaces, with ``kernels``' norm and RoPE: qkv [N, (Hq + 2 Hk) D] ->
    q [N, Hq, D] and k [N, Hk, D] normed and rotated, v [N, Hk, D] as is."""
    n, hk, d = qkv.shape[0], num_kv_heads, head_dim
    q, k, v = qkv.split([qkv.shape[1] - 2 * hk * d, hk * d, hk * d], dim=-1)
    q = kernels.rms_norm(q.reshape(n, -1, d), q_weight, eps)
    k = kernels.rms_norm(k.reshape(n, hk, d), k_weight, eps)
    q, k = kernels.rope(positions, q, k, cos_sin)
    return q, k, v.reshape(n, hk, d)


ROW_GEMV = ("auto", "on", "off")


def check_row_gemv(option: str) -> str:
    """Refuse a ``row_gemv`` option (our Triton linears for inputs of one and of a few rows) other than auto
    (measured per linear), on (every linear, the first correct tile) and off (cuBLAS); returns it."""
    if option not in ROW_GEMV:
        raise ValueError(f"row_gemv must be one of {', '.join(map(repr, ROW_GEMV))}, got {option!r}")
    return option


class TorchKernels:
    """Plain PyTorch versions; numerics follow transformers' Qwen3 (fp32 accumulation, cast back)."""

    name = "torch"
    fuse_qk_rope = False  # the model runs the separate steps; qk_norm_rope_store is the reference of the fusion
    row_gemv = "off"  # linears are F.linear at every row count

    @staticmethod
    def linear(name: str, x: Tensor, layer: nn.Linear) -> Tensor:
        """``layer(x)``; ``name`` (qkv, o_proj, gate_up, down) lets a kernel set choose per linear."""
        return F.linear(x, layer.weight, layer.bias)

    def gate_up_silu(self, x: Tensor, layer: nn.Linear) -> Tensor:
        """SiLU-and-mul of the gate_up linear's output: x [N, H] -> [N, I]."""
        return self.silu_and_mul(self.linear("gate_up", x, layer))

    @staticmethod
    def can_fuse_qk_rope(head_dim: int) -> bool:
        return False

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

    @classmethod
    def qk_norm_rope_store(
        cls, qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos_sin: Tensor,
        flat_cache: Tensor, kv_rows: Tensor,
    ) -> Tensor:  # fmt: skip
        """qkv [N, (Hq + 2 Hk) D] -> q [N, Hq, D] normed and rotated; K (normed, rotated) into
        ``flat_cache [R, Hk, D]`` at rows ``kv_rows[0]``, V at ``kv_rows[1]`` (the fused kernel's contract)."""
        _, hk, d = flat_cache.shape
        q, k, v = qk_norm_rope(cls, qkv, positions, q_weight, k_weight, eps, cos_sin, hk, d)
        flat_cache.index_copy_(0, kv_rows[0], k.to(flat_cache.dtype))
        flat_cache.index_copy_(0, kv_rows[1], v.to(flat_cache.dtype))
        return q


class FlashInferKernels:
    """FlashInfer's fused CUDA kernels (in place where FlashInfer is; callers use the returned tensors).

    ``fuse_qk_rope``: QK-norm, RoPE and the K/V cache writes in one Triton kernel where triton imports (else,
    or with False, the separate FlashInfer kernels and index writes: the A/B switch of the benchmarks).
    """

    name = "flashinfer"

    def __init__(self, fuse_qk_rope: bool = False, row_gemv: str = "off") -> None:
        import flashinfer  # noqa: F401 - fail early and clearly when the gpu extra is missing

        self._fi = flashinfer
        self._fused = None
        if fuse_qk_rope:
            try:
                from . import triton_ops

                self._fused = triton_ops
            except ImportError:
                logger.info("triton is not installed: QK-norm, RoPE and the K/V writes run as separate kernels")
        self.fuse_qk_rope = self._fused is not None
        self._gemv = None
        if check_row_gemv(row_gemv) != "off":
            try:
                from . import triton_gemv

                self._gemv = triton_gemv
            except ImportError:
                logger.info("triton is not installed: one-row linears run on cuBLAS")
        self.row_gemv = row_gemv if self._gemv is not None else "off"
        # linear name -> the Triton tile its one-row inputs use, and the one its inputs of 2 to ``FEW_ROWS`` rows
        # use (``cuda_graphs.kernels.choose_row_linears`` fills them at warm-up, as ``row_gemv`` says); a linear
        # not in a table stays on cuBLAS for those inputs
        self.row_configs: dict = {}
        self.few_row_configs: dict = {}

    def _triton_linear(self, name: str, x: Tensor):
        """(the Triton kernel, its tile) for ``name`` at ``x``'s row count, or None: cuBLAS."""
        rows = x.shape[0]
        if rows == 1:
            config = self.row_configs.get(name)
            return None if config is None else (self._gemv.row_linear, config)
        config = self.few_row_configs.get(name)
        if config is None or rows > self._gemv.FEW_ROWS:
            return None
        return self._gemv.few_rows_linear, config

    def linear(self, name: str, x: Tensor, layer: nn.Linear) -> Tensor:
        chosen = self._triton_linear(name, x)
        if chosen is not None:
            return chosen[0](x.contiguous(), layer.weight, layer.bias, chosen[1])
        return F.linear(x, layer.weight, layer.bias)

    def gate_up_silu(self, x: Tensor, layer: nn.Linear) -> Tensor:
        chosen = self._triton_linear("gate_up", x) if layer.bias is None else None
        if chosen is not None:
            return chosen[0](x.contiguous(), layer.weight, None, chosen[1], silu_mul=True)
        return self.silu_and_mul(F.linear(x, layer.weight, layer.bias))

    def can_fuse_qk_rope(self, head_dim: int) -> bool:
        return self._fused is not None and self._fused.supports(head_dim)

    def qk_norm_rope_store(
        self, qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos_sin: Tensor,
        flat_cache: Tensor, kv_rows: Tensor,
    ) -> Tensor:  # fmt: skip
        assert self._fused is not None, "qk_norm_rope_store without the fused kernel (check can_fuse_qk_rope)"
        return self._fused.qk_norm_rope_store(qkv, positions, q_weight, k_weight, eps, cos_sin, flat_cache, kv_rows)

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


# Head sizes FlashInfer's attention serves: its FA2 prefill kernels are right only at multiples of 64 (others give
# an illegal memory access, or below a multiple of 16 silently wrong rows: flashinfer#4299, unchecked up to 0.6.18),
# and 64 / 128 / 256 are the sizes it dispatches and tests
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def default_kernels(
    device: torch.device | str, fuse_qk_rope: bool = False, row_gemv: str = "off", head_dim: int | None = None
) -> TorchKernels | FlashInferKernels:
    """FlashInfer kernels on CUDA when FlashInfer is installed and serves ``head_dim`` (``FLASHINFER_HEAD_DIMS``;
    None: not asked) (``fuse_qk_rope``: with the Triton fusion, and ``row_gemv``: the one-row Triton GEMV's option,
    where triton imports), else the torch reference, whose attention is SDPA (every graph mode captures over it)."""
    if torch.device(device).type == "cuda" and head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        logger.warning("head_dim %d: FlashInfer's attention serves only %s; the torch kernels and SDPA run instead",
                       head_dim, "/".join(map(str, FLASHINFER_HEAD_DIMS)))  # fmt: skip
        return TorchKernels()
    if torch.device(device).type == "cuda":
        try:
            return FlashInferKernels(fuse_qk_rope, row_gemv)
        except ImportError:
            pass
    return TorchKernels()
