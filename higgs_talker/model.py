"""The talker network: a Qwen3 decoder plus the fused eight-codebook embedding/head.

The model sees flat tokens: ``embeds [N, H]`` and ``positions [N]`` for every request of a step; attention
reaches the step's backend through ``attention.use_backend``. It knows nothing about batching or graphs.
Parameter names are the mapped checkpoint names (``checkpoint.map_key``); q/k/v and gate/up are packed into
``qkv_proj`` and ``gate_up_proj`` (one matmul each), as vLLM does.

The layers have vLLM's Qwen3 shapes: ``DecoderLayer.forward(positions, hidden_states, residual) -> (hidden,
residual)``, norms called as ``norm(x)`` or ``norm(x, residual) -> (normed, residual)``, and the submodules
``input_layernorm``, ``self_attn(positions=, hidden_states=)``, ``post_attention_layernorm`` and ``mlp``.
So ``forward_layers`` (the one layer loop, with the local MLP graph hook) runs ours and vLLM's alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .attention import current_backend
from .config import TalkerConfig, TextConfig
from .heads.codebooks import build_codebooks
from .ops import TorchKernels, qk_norm_rope, rope_cache

Kernels = TorchKernels  # any object with the TorchKernels methods (see ops.FlashInferKernels)
# (layer index, hidden [N, H], residual [N, H]) -> (mlp output, residual): the local MLP graph hook
PostAttention = Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """norm(x) [..., D]; with ``residual``: (norm(x + residual), x + residual) (FlashInfer: in place)."""
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE's cos/sin table [max_positions, head_dim] fp32, shared by every layer (the attention
    applies it through its kernels: ``ops.qk_norm_rope`` or the fused kernel)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        if torch.empty(0).is_meta:  # built on the meta device (api._empty_model, which computes it on its device)
            table = torch.empty(cfg.max_position_embeddings, cfg.head_dim)  # no meta ops: see Qwen3Model
        else:
            table = rope_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.register_buffer("cos_sin", table, persistent=False)


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, rotary: RotaryEmbedding, kernels: Kernels) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
        self.rotary_emb = rotary
        self.kernels = kernels

    def forward(self, positions: Tensor, hidden_states: Tensor) -> Tensor:
        """hidden [N, H] -> [N, H]; K/V go into the cache of the step's backend."""
        qkv = self.kernels.linear("qkv", hidden_states, self.qkv_proj)  # [N, (Hq + 2 Hk) * D]
        backend = current_backend()
        kv_dest = backend.kv_destination(self.layer_idx) if self.kernels.can_fuse_qk_rope(self.head_dim) else None
        if kv_dest is not None:  # one kernel: QK-norm, RoPE, and K/V straight into the cache
            norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.rotary_emb.cos_sin)
            out = backend.attend_qkv(self.layer_idx, qkv, positions, *norm)  # that kernel inside the attention's
            if out is None:
                q = self.kernels.qk_norm_rope_store(qkv, positions, *norm, *kv_dest)
                out = backend.attend(self.layer_idx, q)
            return self.kernels.linear("o_proj", out, self.o_proj)
        q, k, v = qk_norm_rope(self.kernels, qkv, positions, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                               self.rotary_emb.cos_sin, self.num_kv_heads, self.head_dim)  # fmt: skip
        return self.kernels.linear("o_proj", backend.forward(self.layer_idx, q, k, v), self.o_proj)  # -> [N, H]


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig, kernels: Kernels) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.kernels = kernels

    def forward(self, x: Tensor) -> Tensor:
        return self.kernels.linear("down", self.kernels.gate_up_silu(x, self.gate_up_proj), self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, rotary: RotaryEmbedding, kernels: Kernels) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, layer_idx, rotary, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg, kernels)

    def forward(self, positions: Tensor, hidden_states: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        hidden_states, residual = attention_block(self, positions, hidden_states, residual)
        return post_attention_block(self, hidden_states, residual)


def attention_block(
    layer: nn.Module, positions: Tensor, hidden: Tensor, residual: Tensor | None
) -> tuple[Tensor, Tensor]:
    """input_layernorm (with the residual add after the first layer) + self-attention of a Qwen3 layer (ours
    or vLLM's) -> (attention output, residual)."""
    if residual is None:
        residual = hidden
        hidden = layer.input_layernorm(hidden)
    else:
        hidden, residual = layer.input_layernorm(hidden, residual)
    return layer.self_attn(positions=positions, hidden_states=hidden), residual


def post_attention_block(layer: nn.Module, hidden: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """post_attention_layernorm (fused residual add) + MLP of a Qwen3 layer (ours or vLLM's): what the local
    MLP graphs capture."""
    hidden, residual = layer.post_attention_layernorm(hidden, residual)
    return layer.mlp(hidden), residual


def forward_layers(
    layers: Sequence[nn.Module], positions: Tensor, hidden: Tensor, post_attention: PostAttention | None = None
) -> tuple[Tensor, Tensor]:
    """Run Qwen3 decoder layers (ours or vLLM's) on hidden [N, H] -> (hidden, residual) before the final norm.

    ``post_attention(i, hidden, residual)`` replaces layer i's post-attention block (the local MLP graph hook).
    """
    residual = None
    for i, layer in enumerate(layers):
        hidden, residual = attention_block(layer, positions, hidden, residual)
        if post_attention is None:
            hidden, residual = post_attention_block(layer, hidden, residual)
        else:
            hidden, residual = post_attention(i, hidden, residual)
    return hidden, residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: TextConfig, kernels: Kernels) -> None:
        super().__init__()
        self.cfg = cfg
        # no default init (every weight is loaded or drawn): normal_ on the meta device (api._empty_model) runs
        # torch's Python reference ops, whose first call imports torch._dynamo (seconds at start)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, kernels) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)


class TalkerModel(nn.Module):
    """Qwen3 backbone + text head + fused codebook embedding/head.

    ``forward(embeds [N, H], positions [N]) -> hidden [N, H]`` (final-normed), inside ``use_backend(...)``.
    """

    def __init__(self, cfg: TalkerConfig, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        t = cfg.text
        self.kernels = kernels or TorchKernels()
        self.model = Qwen3Model(t, self.kernels)
        if not t.tie_word_embeddings:
            self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        self.multimodal_embedding, self.modality_head = build_codebooks(cfg)

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        return self.model.layers[0].self_attn.rotary_emb

    def use_kernels(self, kernels: Kernels) -> None:
        """Switch every layer to these elementwise kernels (e.g. FlashInfer's on CUDA)."""
        self.kernels = kernels
        for module in self.modules():
            if module is not self and hasattr(module, "kernels"):
                module.kernels = kernels

    def tie_weights(self) -> None:
        """Re-share the fused table with the head (after ``to_empty`` or other re-materialisation)."""
        if self.cfg.tie_modality_embeddings:
            self.modality_head.weight = self.multimodal_embedding.weight

    @property
    def text_head_weight(self) -> Tensor:
        """[vocab, H]: lm_head, or the text embedding when tied."""
        return self.model.embed_tokens.weight if self.cfg.text.tie_word_embeddings else self.lm_head.weight

    def embed_text(self, input_ids: Tensor) -> Tensor:
        """input_ids [N] -> [N, H]; negative ids (placeholders) embed as id 0 and must be replaced."""
        return self.model.embed_tokens(input_ids.clamp(min=0))

    def forward(self, embeds: Tensor, positions: Tensor, post_attention: PostAttention | None = None) -> Tensor:
        """embeds [N, H], positions [N] -> final-normed hidden [N, H]."""
        hidden, residual = forward_layers(self.model.layers, positions, embeds, post_attention)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden
