"""The fused multi-codebook table ``W_a [num_codebooks * codebook_size, H]`` (SPEC 2.2).

As an embedding, one frame's codes pick one row per codebook (codebook ``c`` owns rows
``c * codebook_size ...``) and the rows are summed. As the head (tied to the same table by default), one
hidden row becomes logits ``[num_codebooks, codebook_size]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FusedCodebookEmbedding(nn.Module):
    def __init__(self, num_codebooks: int, codebook_size: int, hidden_size: int) -> None:
        super().__init__()
        self.num_codebooks, self.codebook_size = num_codebooks, codebook_size
        self.weight = nn.Parameter(torch.empty(num_codebooks * codebook_size, hidden_size))
        # from Python ints, no tensor arithmetic: on the meta device that would run torch's Python reference ops
        offsets = torch.tensor([c * codebook_size for c in range(num_codebooks)])
        self.register_buffer("offsets", offsets, persistent=False)

    def forward(self, codes: Tensor) -> Tensor:
        """codes [..., num_codebooks] int in [0, codebook_size) -> summed rows [..., H] in the table dtype.

        CPU inputs are range-checked (an out-of-range code would silently index the next codebook's
        rows); CUDA inputs come from the sampler or from validated prompts and are not (no host sync).
        """
        if codes.shape[-1] != self.num_codebooks:
            raise ValueError(
                f"codes must have {self.num_codebooks} codebooks in the last dim, got shape {list(codes.shape)}"
            )
        if codes.device.type == "cpu" and codes.numel():
            lo, hi = int(codes.min()), int(codes.max())
            if lo < 0 or hi >= self.codebook_size:
                bad = lo if lo < 0 else hi
                raise IndexError(f"audio code {bad} is outside [0, {self.codebook_size})")
        return F.embedding(codes.long() + self.offsets, self.weight).sum(dim=-2)


class FusedCodebookHead(nn.Module):
    """hidden [B, H] -> logits [B, num_codebooks, codebook_size] (model dtype)."""

    def __init__(
        self, num_codebooks: int, codebook_size: int, hidden_size: int, tied_to: FusedCodebookEmbedding | None = None
    ) -> None:
        super().__init__()
        self.num_codebooks, self.codebook_size = num_codebooks, codebook_size
        if tied_to is not None:
            self.weight = tied_to.weight  # the same Parameter: tying shares storage
        else:
            self.weight = nn.Parameter(torch.empty(num_codebooks * codebook_size, hidden_size))

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.weight).view(hidden.shape[0], self.num_codebooks, self.codebook_size)


def build_codebooks(cfg) -> tuple[FusedCodebookEmbedding, FusedCodebookHead]:
    """The fused table and its head for a ``TalkerConfig`` (the head shares the table when tied)."""
    embedding = FusedCodebookEmbedding(cfg.num_codebooks, cfg.codebook_size, cfg.hidden_size)
    head = FusedCodebookHead(
        cfg.num_codebooks,
        cfg.codebook_size,
        cfg.hidden_size,
        tied_to=embedding if cfg.tie_modality_embeddings else None,
    )
    return embedding, head


def rows_at(positions: Tensor, where: Tensor, codes: Tensor) -> tuple[Tensor, Tensor]:
    """Which tokens of a span carry a code row instead of text: positions [S] int64 of the span's tokens,
    ``where`` [R] int64 the positions of ``codes`` [R, C] (reference rows at their placeholders, or the rows fed
    back at positions a preempted request recomputes). Returns (indices into the span [K] int64, rows [K, C])."""
    if where.numel() == 0:
        return positions.new_zeros(0), codes[:0]
    where, order = where.to(positions.device).sort()
    idx = torch.searchsorted(where, positions).clamp(max=where.numel() - 1)
    tok = torch.nonzero(where[idx] == positions).flatten()
    return tok, codes[order[idx[tok]].to(codes.device)]


def embed_rows(embeds: Tensor, index: Tensor, codes: Tensor, embedding: nn.Module) -> Tensor:
    """embeds [N, H] -> [N, H] with the tokens at ``index`` [M] embedded from their rows ``codes`` [M, C]."""
    if index.numel() == 0:
        return embeds
    rows = embedding(codes.to(embeds.device).long()).to(embeds.dtype)
    return embeds.index_copy(0, index.to(embeds.device), rows)


def feed_back(embeds: Tensor, use: Tensor, codes: Tensor, embedding: nn.Module) -> Tensor:
    """The audio feedback (SPEC 4.8): embeds [N, H] -> [N, H] where tokens with ``use`` [N] bool embed their
    request's last frame ``codes`` [N, C] instead (dense, graph-safe)."""
    return torch.where(use[:, None], embedding(codes).to(embeds.dtype), embeds)
