"""One vLLM step of the talker, as pure torch functions over the request-keyed state pool (no vLLM import).

A step's tokens are flat: ``qsl [B+1]`` splits them into requests (vLLM's ``query_start_loc``); the row a
request is sampled from is its last scheduled token. The decode logic itself is the core's
(``heads.delay``, ``heads.sampling``); these functions only translate vLLM's batch layout onto it:

- which rows are in audio mode (their text token is forced to ``<|audio|>`` or EOS), which start a stream
  (the prompt's tail is ``<|audio|>``), and which are due to produce a frame;
- audio feedback: a single-token span whose request is in a stream embeds its previous frame;
- the codes of one step, the delay-state update, and the per-slot bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import TalkerConfig
from ..heads.delay import DelayState, apply_delay_mask, forced_text_tokens, update_state
from ..heads.sampling import sample_codes
from .state import RequestStatePool


@dataclass
class StepBatch:
    """What the adapter knows about the current step (set before forward, consumed by sampling)."""

    req_ids: list[str]
    slots: Tensor  # [B] int64 pool slots, batch order
    qsl: Tensor  # [B+1] int64 token span of each request
    input_ids: Tensor  # [T] int64 scheduled token ids
    positions: Tensor  # [T] int64 absolute positions
    new_rows: list[int]  # batch indices of requests seen for the first time this step

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def tails(self) -> Tensor:
        """[B] index of each request's last scheduled token (the row it is sampled from)."""
        return self.qsl[1:] - 1


@dataclass
class RowModes:
    """Per-row masks of one step, [B] bool (device), plus the forced text token [B] int64."""

    seed: Tensor  # starts an audio stream now (prompt tail is <|audio|>, no stream yet)
    active: Tensor  # already in a stream
    done: Tensor  # terminal row was emitted last step: EOS is forced now and the stream closes
    audio: Tensor  # text token is forced this step
    code_rows: Tensor  # produces a frame this step
    forced: Tensor  # <|audio|> or EOS


def row_modes(batch: StepBatch, pool: RequestStatePool, audio_id: int, eos_id: int) -> RowModes:
    """Classify the rows of a step from the tail tokens and the pooled state (graph-safe, no host sync).

    A stream row is *due* only when its tail sits at the position its next frame belongs to
    (``seed_pos + rows produced``), so a partial prefill chunk (its output is discarded by vLLM) never
    advances a stream.
    """
    tails = batch.tails
    tail_ids = batch.input_ids.index_select(0, tails)
    tail_pos = batch.positions.index_select(0, tails)
    slots = batch.slots
    active = pool.state.has_codes.index_select(0, slots)
    done = pool.state.done.index_select(0, slots)
    prev_audio = tail_ids == audio_id
    seed = prev_audio & ~active & ~done
    due = tail_pos == pool.seed_pos.index_select(0, slots) + pool.num_rows.index_select(0, slots)
    return RowModes(
        seed=seed,
        active=active,
        done=done,
        audio=prev_audio | active | done,
        code_rows=(seed | (active & due)) & ~done,
        forced=forced_text_tokens(done, audio_id, eos_id),
    )


def force_text_logits(logits: Tensor, modes: RowModes) -> Tensor:
    """Text logits [B, V]: audio-mode rows keep only their forced token's logit (others -inf), in place."""
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, modes.forced[:, None], True)
    return logits.masked_fill_(modes.audio[:, None] & ~keep, float("-inf"))


def forced_only_logits(modes: RowModes, vocab_size: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """[B, V] logits with only the forced token finite (0) per row: the text head is not computed."""
    b = modes.forced.shape[0]
    out = torch.full((b, vocab_size), float("-inf"), dtype=dtype, device=modes.forced.device)
    return out.scatter_(1, modes.forced[:, None], 0.0)


def write_feedback(batch: StepBatch, pool: RequestStatePool, use: Tensor, codes: Tensor) -> None:
    """Fill the per-token feedback buffers (fixed storage) for a step of at most ``use.shape[0]`` tokens.

    use [S] bool, codes [S, N] int64: token ``t`` is fed frame ``codes[t]`` where ``use[t]``. A request's tail
    token gets its previous frame when the request is in a stream and has a single-token span (a decode
    step); everything else is cleared. Runs before the forward, outside any captured graph.
    """
    slots, tails = batch.slots, batch.tails
    spans = batch.qsl[1:] - batch.qsl[:-1]
    use.zero_()
    use.index_copy_(0, tails, pool.state.has_codes.index_select(0, slots) & (spans == 1))
    codes.index_copy_(0, tails, pool.state.last_codes.index_select(0, slots))


def apply_feedback(embeds: Tensor, use: Tensor, codes: Tensor, embed_codes) -> Tensor:
    """embeds [T, H] -> [T, H] with fed tokens replaced by ``embed_codes(codes) [T, H]`` (dense, graph-safe)."""
    t = embeds.shape[0]
    fed = embed_codes(codes[:t]).to(embeds.dtype)
    return torch.where(use[:t, None], fed, embeds)


def feedback_sparse(embeds: Tensor, batch: StepBatch, pool: RequestStatePool, embed_codes) -> Tensor:
    """The same replacement for a step larger than the buffers (a big prefill): only the tail rows change."""
    slots, tails = batch.slots, batch.tails
    spans = batch.qsl[1:] - batch.qsl[:-1]
    use = pool.state.has_codes.index_select(0, slots) & (spans == 1)
    fed = embed_codes(pool.state.last_codes.index_select(0, slots)).to(embeds.dtype)
    current = embeds.index_select(0, tails)
    return embeds.index_copy(0, tails, torch.where(use[:, None], fed, current))


def sample_step(
    hidden: Tensor,
    batch: StepBatch,
    modes: RowModes,
    pool: RequestStatePool,
    head,
    cfg: TalkerConfig,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
) -> tuple[Tensor, DelayState]:
    """Sample this step's frames and advance the pooled state.

    hidden [B, H] (the rows vLLM selected for sampling), ``head(hidden) -> [B, N, V]``; temperature/top_p
    [B] float, top_k [B] int64 (>= V: off). Returns the emitted rows [B, N] int64 (-1 where no frame) and
    the new batch-ordered state.
    """
    slots = batch.slots
    boc, eoc, n = cfg.boc_id, cfg.eoc_id, cfg.num_codebooks
    state = pool.state.gather(slots)
    # seed rows open a fresh stream; done rows close theirs (their EOS is forced this step)
    fresh = modes.seed | modes.done
    state = DelayState(
        last_codes=torch.where(fresh[:, None], boc, state.last_codes),
        has_codes=state.has_codes & ~fresh,
        delay=torch.where(fresh, 0, state.delay),
        countdown=torch.where(fresh, -1, state.countdown),
        done=state.done & ~fresh,
    )
    tail_pos = batch.positions.index_select(0, batch.tails)
    pool.seed_pos.index_copy_(0, slots, torch.where(modes.seed, tail_pos, pool.seed_pos.index_select(0, slots)))
    steps = torch.where(modes.seed, 0, pool.num_rows.index_select(0, slots))
    logits = head(hidden).float()  # [B, N, V]
    apply_delay_mask(logits, state.delay, state.countdown, boc, eoc)
    k = torch.where((top_k <= 0) | (top_k > cfg.codebook_size), cfg.codebook_size, top_k)
    codes = sample_codes(logits, temperature, k, top_p, pool.seeds.index_select(0, slots), steps)
    emitted, new = update_state(codes, state, modes.code_rows, boc, eoc)
    pool.state.scatter(slots, new)
    pool.num_rows.index_copy_(0, slots, steps + modes.code_rows.long())
    assert emitted.shape == (slots.shape[0], n)
    return emitted, new


def step_params(
    num_rows: int,
    codebook_size: int,
    device: torch.device,
    temperature: Tensor | None = None,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (temperature, top_k, top_p) with vLLM's "None = off / greedy" conventions filled in."""
    t = torch.zeros(num_rows, device=device) if temperature is None else temperature[:num_rows].float()
    k = (
        torch.full((num_rows,), codebook_size, dtype=torch.long, device=device)
        if top_k is None
        else top_k[:num_rows].long()
    )
    p = torch.ones(num_rows, device=device) if top_p is None else top_p[:num_rows].float()
    # vLLM marks greedy rows with temperature 0 (or below a tiny epsilon); non-finite values sample at 1
    t = torch.where(torch.isfinite(t), t, 1.0)
    p = torch.where(torch.isfinite(p), p.clamp(0.0, 1.0), 1.0)
    p = torch.where(p <= 0, 1.0, p)
    return t, k, p
