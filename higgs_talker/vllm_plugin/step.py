"""One vLLM step of the talker: vLLM's batch layout translated onto the core's frame step (no vLLM import).

A step's tokens are flat: ``qsl [B+1]`` splits them into requests (vLLM's ``query_start_loc``); the row a
request is sampled from is its last scheduled token. The decode logic itself is the core's
(``heads.slots.sample_frame``, ``heads.delay``); these functions only decide, from vLLM's tokens:

- which rows are in audio mode (their text token is forced to ``<|audio|>`` or EOS), which start a stream
  (the prompt's tail is ``<|audio|>``), and which are due to produce a frame;
- audio feedback: a single-token span whose request is in a stream embeds its previous frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..heads.delay import DelayState, forced_text_tokens
from ..heads.slots import sample_frame
from .state import RequestSlots


@dataclass
class VllmStep:
    """What the adapter knows about the current step (set before forward, consumed by sampling)."""

    req_ids: list[str]
    slots: Tensor  # [B] int64 decode-state slots, batch order
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


def row_modes(step: VllmStep, slots: RequestSlots, audio_id: int, eos_id: int) -> RowModes:
    """Classify the rows of a step from the tail tokens and the pooled state (graph-safe, no host sync).

    A stream row is *due* only when its tail sits at the position its next frame belongs to
    (``seed_pos + rows produced``), so a partial prefill chunk (its output is discarded by vLLM) never
    advances a stream.
    """
    tails = step.tails
    tail_ids = step.input_ids.index_select(0, tails)
    tail_pos = step.positions.index_select(0, tails)
    s, state = step.slots, slots.store.state
    active = state.has_codes.index_select(0, s)
    done = state.done.index_select(0, s)
    prev_audio = tail_ids == audio_id
    seed = prev_audio & ~active & ~done
    due = tail_pos == slots.seed_pos.index_select(0, s) + slots.store.num_rows.index_select(0, s)
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


def _tail_feedback(step: VllmStep, slots: RequestSlots) -> tuple[Tensor, Tensor]:
    """Per request [B]: whether its tail token is fed back (in a stream, single-token span) and its last codes
    [B, C]."""
    s, state = step.slots, slots.store.state
    single = (step.qsl[1:] - step.qsl[:-1]) == 1
    return state.has_codes.index_select(0, s) & single, state.last_codes.index_select(0, s)


def write_feedback(step: VllmStep, slots: RequestSlots, use: Tensor, codes: Tensor) -> None:
    """Fill the per-token feedback buffers (fixed storage) for a step of at most ``use.shape[0]`` tokens.

    use [S] bool, codes [S, C] int64: token ``t`` is fed frame ``codes[t]`` where ``use[t]``. A request's tail
    token gets its previous frame when the request is in a stream and has a single-token span (a decode
    step); everything else is cleared. Runs before the forward, outside any captured graph.
    """
    fed, last = _tail_feedback(step, slots)
    use.zero_()
    use.index_copy_(0, step.tails, fed)
    codes.index_copy_(0, step.tails, last)


def apply_feedback(embeds: Tensor, use: Tensor, codes: Tensor, embed_codes) -> Tensor:
    """embeds [T, H] -> [T, H] with fed tokens replaced by ``embed_codes(codes) [T, H]`` (dense, graph-safe)."""
    t = embeds.shape[0]
    fed = embed_codes(codes[:t]).to(embeds.dtype)
    return torch.where(use[:t, None], fed, embeds)


def feedback_sparse(embeds: Tensor, step: VllmStep, slots: RequestSlots, embed_codes) -> Tensor:
    """The same replacement for a step larger than the buffers (a big prefill): only the tail rows change."""
    use, last = _tail_feedback(step, slots)
    fed = embed_codes(last).to(embeds.dtype)
    current = embeds.index_select(0, step.tails)
    return embeds.index_copy(0, step.tails, torch.where(use[:, None], fed, current))


def sample_step(
    hidden: Tensor, step: VllmStep, modes: RowModes, slots: RequestSlots, head, params: tuple[Tensor, Tensor, Tensor]
) -> tuple[Tensor, DelayState]:
    """This step's frames: hidden [B, H] (the rows vLLM sampled from) -> emitted rows [B, C] int64 (-1 where no
    frame) and the new batch-ordered state. Seed rows open a fresh stream (remembering where it started), done
    rows close theirs; params are vLLM's per-row (temperature, top_k, top_p)."""
    tail_pos = step.positions.index_select(0, step.tails)
    slots.seed_pos.index_copy_(
        0, step.slots, torch.where(modes.seed, tail_pos, slots.seed_pos.index_select(0, step.slots))
    )
    logits = head(hidden).float()  # [B, C, V]
    return sample_frame(
        slots.store, step.slots, logits, params=params, active=modes.code_rows, fresh=modes.seed | modes.done
    )
