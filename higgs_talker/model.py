"""The talker network: a Qwen3 decoder plus the fused eight-codebook embedding/head.

The model sees flat tokens: ``hidden [N, H]`` and ``positions [N]`` for every request of a step, plus an
attention backend that already knows the step's metadata. It knows nothing about batching or graphs.
Parameter names are the mapped checkpoint names (``checkpoint.map_key``); q/k/v and gate/up are packed
into ``qkv_proj`` and ``gate_up_proj`` (one matmul each), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .attention import AttentionBackend
from .config import TalkerConfig, TextConfig
from .heads.codebooks import build_codebooks
from .ops import TorchKernels, rope_cache

Kernels = TorchKernels  # any object with the TorchKernels methods (see ops.FlashInferKernels)
# (layer index, hidden [N, H], residual [N, H]) -> (mlp output, residual): the local MLP graph hook
PostAttention = Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self, layer: int, positions: Tensor, hidden: Tensor, attn: AttentionBackend, kernels: Kernels, cos_sin: Tensor
    ) -> Tensor:
        """hidden [N, H] -> [N, H]."""
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = kernels.rms_norm(q.reshape(n, self.num_heads, self.head_dim), self.q_norm.weight, self.q_norm.eps)
        k = kernels.rms_norm(k.reshape(n, self.num_kv_heads, self.head_dim), self.k_norm.weight, self.k_norm.eps)
        q, k = kernels.rope(positions, q, k, cos_sin)  # [N, Hq, D], [N, Hk, D]
        out = attn.forward(layer, q, k, v.reshape(n, self.num_kv_heads, self.head_dim))  # [N, Hq*D]
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, kernels: Kernels) -> Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def post_attention(self, hidden: Tensor, residual: Tensor, kernels: Kernels) -> tuple[Tensor, Tensor]:
        """post_attention_layernorm (fused residual add) + MLP: the block the local MLP graphs capture."""
        norm = self.post_attention_layernorm
        hidden, residual = kernels.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mlp(hidden, kernels), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TalkerModel(nn.Module):
    """Qwen3 backbone + text head + fused codebook embedding/head.

    ``forward(embeds [N, H], positions [N], attn) -> hidden [N, H]`` (final-normed).
    """

    def __init__(self, cfg: TalkerConfig, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        t = cfg.text
        self.model = Qwen3Model(t)
        if not t.tie_word_embeddings:
            self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        self.multimodal_embedding, self.modality_head = build_codebooks(cfg)
        self.kernels = kernels or TorchKernels()
        self.register_buffer(
            "cos_sin", rope_cache(t.head_dim, t.max_position_embeddings, t.rope_theta), persistent=False
        )

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

    def forward(
        self, embeds: Tensor, positions: Tensor, attn: AttentionBackend, post_attention: PostAttention | None = None
    ) -> Tensor:
        """embeds [N, H], positions [N] -> final-normed hidden [N, H].

        ``post_attention`` replaces each layer's eager post-attention block (the local MLP graph hook).
        """
        k = self.kernels
        hidden, residual = embeds, None
        for i, layer in enumerate(self.model.layers):
            norm = layer.input_layernorm
            if residual is None:
                residual = hidden
                hidden = k.rms_norm(hidden, norm.weight, norm.eps)
            else:
                hidden, residual = k.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
            hidden = layer.self_attn(i, positions, hidden, attn, k, self.cos_sin)
            if post_attention is not None:
                hidden, residual = post_attention(i, hidden, residual)
            else:
                hidden, residual = layer.post_attention(hidden, residual, k)
        norm = self.model.norm
        hidden, _ = k.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return hidden

    def text_logits(self, hidden: Tensor, token_ids: Tensor | None = None) -> Tensor:
        """hidden [B, H] -> text logits [B, vocab] fp32, or only the columns ``token_ids`` [K] -> [B, K]."""
        weight = self.text_head_weight if token_ids is None else self.text_head_weight.index_select(0, token_ids)
        return (hidden @ weight.t()).float()
