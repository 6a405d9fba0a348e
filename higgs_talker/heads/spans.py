"""One step of a flat token batch split into per-request spans (vLLM's layout) on the decode-state slots.

``qsl [B+1]`` splits the step's tokens into requests (vLLM's ``query_start_loc``); a request is sampled from its
last scheduled token (its *tail*). From the tail tokens and the slots' state this decides which rows are in
audio mode (their text token is forced), which open a stream (the tail is ``<|audio|>``) and which are due a
frame, feeds each tail its last frame, and samples the frames with ``sample_frame``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .codebooks import embed_rows, feed_back, rows_at
from .delay import forced_text_tokens
from .sampling import resolve_seed, row_params
from .slots import HostRequest, RequestSlots, sample_frame

if TYPE_CHECKING:
    from ..config import SpecialTokens

logger = logging.getLogger(__name__)

# frame(slots, head, step_slots, hidden, tail_ids, tail_pos, params) -> results [B, C + 3]: ``frame_results`` with
# its stream tokens bound
FrameFn = Callable[..., Tensor]


@dataclass
class RowModes:
    """Per-row masks of one step, [B] bool (device), plus the forced text token [B] int64."""

    seed: Tensor  # starts an audio stream now (prompt tail is <|audio|>, no stream yet)
    done: Tensor  # terminal row was emitted last step: EOS is forced now and the stream closes
    audio: Tensor  # text token is forced this step
    code_rows: Tensor  # produces a frame this step
    forced: Tensor  # <|audio|> or EOS


@dataclass
class SpanStep:
    """One step, from its requests and token layout to the frames it sampled (the vLLM adapter's step)."""

    req_ids: list[str]
    references: list | None = None  # voice-clone infos in batch order (the bridge's; the runner passes its own)
    slots: Tensor | None = None  # [B] int64 decode-state slots; None until the token layout is known
    qsl: Tensor | None = None  # [B+1] int64 token span of each request
    input_ids: Tensor | None = None  # [T] int64
    positions: Tensor | None = None  # [T] int64
    new_rows: list[int] = field(default_factory=list)  # batch indices of requests seen for the first time
    one_token_each: bool = False  # a pure decode step: token i is request i's tail (no span arithmetic needed)
    hidden: Tensor | None = None  # [B, H] the rows sampled from (compute_logits)
    forced: Tensor | None = None  # [B] int64 each row's forced text token (set by ``text_logits``)
    all_forced: bool = False  # the host knew every row to be in audio mode (``text_logits`` skipped the head)
    modes: RowModes | None = None  # the rows' modes, where ``text_logits`` needed them (a row may be in text mode)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def laid_out(self) -> bool:
        """Whether the step's token layout is known (the text-only bridge names the requests before it comes)."""
        return self.slots is not None

    def lay_out(self, slots: RequestSlots, input_ids: Tensor, positions: Tensor, qsl: Tensor) -> SpanStep:
        """Take the step's token layout, input_ids / positions [T] and qsl [>= B+1], and its requests' slots
        (a request seen for the first time gets one, listed in ``new_rows``)."""
        self.slots, self.new_rows = slots.sync(self.req_ids)
        self.qsl, self.input_ids, self.positions = qsl[: self.num_reqs + 1].long(), input_ids.long(), positions.long()
        self.one_token_each = input_ids.shape[0] == self.num_reqs  # B spans of >= 1 token in B tokens
        return self

    @property
    def tails(self) -> Tensor:
        """[B] index of each request's last scheduled token."""
        return self.qsl[1:] - 1

    def tail_tokens(self) -> tuple[Tensor, Tensor]:
        """(token ids, positions) [B] of the requests' tails; a step of one token per request is its own tails."""
        if self.one_token_each:
            return self.input_ids, self.positions
        tails = self.tails
        return self.input_ids.index_select(0, tails), self.positions.index_select(0, tails)

    def row_modes(self, slots: RequestSlots, audio_id: int, eos_id: int) -> RowModes:
        """The rows' modes (``row_modes`` of the tails)."""
        return row_modes(slots, self.slots, *self.tail_tokens(), audio_id, eos_id)

    def text_logits(
        self,
        slots: RequestSlots,
        hidden: Tensor,
        specials: SpecialTokens,
        text_head: Callable[[Tensor], Tensor],
        vocab_size: int,
    ) -> tuple[Tensor, bool]:
        """hidden [B, H] -> (text logits [B, V], whether the text head was skipped); ``hidden`` and the forced text
        tokens are kept for ``sample``. When the host knows every request is in audio mode, neither the head nor
        the rows' modes are computed (the frame work classifies the rows itself): a row's forced token is EOS after
        its terminal row, else ``<|audio|>`` (``forced_only_logits``). Otherwise the rows are classified
        (``row_modes``) and audio-mode rows keep only their forced token."""
        self.hidden, self.all_forced = hidden, slots.all_forced(self.req_ids)
        if self.all_forced:
            done = slots.store.state.done.index_select(0, self.slots)
            self.forced, self.modes = forced_text_tokens(done, specials.audio, specials.eos), None
            return forced_only_logits(self.forced, vocab_size, hidden.dtype), True
        self.modes = self.row_modes(slots, specials.audio, specials.eos)
        self.forced = self.modes.forced
        return force_text_logits(text_head(hidden), self.modes), False

    def tail_feedback(self, slots: RequestSlots) -> tuple[Tensor, Tensor]:
        """Per request [B]: whether its tail is fed its last frame (in a stream, one-token span), and that
        frame [B, C]."""
        state = slots.store.state
        fed, last = state.has_codes.index_select(0, self.slots), state.last_codes.index_select(0, self.slots)
        return (fed if self.one_token_each else fed & ((self.qsl[1:] - self.qsl[:-1]) == 1)), last

    def feed_tails(self, slots: RequestSlots, embeds: Tensor, embedding) -> Tensor:
        """embeds [T, H] -> [T, H] with each decoding tail fed its last frame (``feed_back`` on the tails only:
        for a step larger than the fixed feedback buffers)."""
        use, last = self.tail_feedback(slots)
        return embeds.index_copy(0, self.tails, feed_back(embeds.index_select(0, self.tails), use, last, embedding))

    def write_feedback(self, slots: RequestSlots, use: Tensor, codes: Tensor) -> None:
        """Fill the fixed per-token feedback buffers use [S] bool, codes [S, C] for this step (before the
        forward, outside any captured graph): tails of decoding streams get their last frame, the rest nothing."""
        fed, last = self.tail_feedback(slots)
        use.zero_()
        if self.one_token_each:
            use[: self.num_reqs].copy_(fed)
            codes[: self.num_reqs].copy_(last)
        else:
            use.index_copy_(0, self.tails, fed)
            codes.index_copy_(0, self.tails, last)

    def sample(self, slots: RequestSlots, head, frame: FrameFn, params: tuple, frames=None) -> None:
        """Sample this step's frames from ``hidden`` with ``frame`` (``frame_results`` with the stream tokens
        bound), their host record left to ``slots.settle`` (no host sync here: the host may go on to the next step
        while this one runs); params: (temperature, top_k, top_p) as the front end has them (``row_params``).
        ``frames`` (``cuda_graphs.frame.FrameGraphs``) replays the same work from a CUDA graph where it holds the
        batch."""
        args = (self.slots, self.hidden, *self.tail_tokens(), params)
        results = frames.run(*args) if frames is not None else None
        if results is None:
            results = frame(slots, head, *args)
        slots.record_later(self.req_ids, results)

    def adopt_seeds(self, slots: RequestSlots, seeds: dict[int, int]) -> None:
        """vLLM hands a request's own seed over (batch index -> seed) at its first sample: the requests new this
        step take theirs; the others keep the seed they have sampled with."""
        for i, seed in seeds.items():
            if i in self.new_rows:
                slots.set_seed(self.req_ids[i], resolve_seed(seed))

    def span(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """(input_ids, positions) [end - start] of the step's tokens ``start:end``."""
        return self.input_ids[start:end], self.positions[start:end]

    def prompt_rows(self, slots: RequestSlots, infos: list, embeds: Tensor, embedding) -> tuple[Tensor, int]:
        """Multi-token spans embed code rows at their positions (SPEC 3.4): request i's voice-clone rows
        (``reference_rows`` of ``infos``, in batch order) and, where a preempted request is recomputed from
        position 0, the rows it was fed the first time (row j at seed_pos + 1 + j), so the recomputed KV and the
        codes after it are what they were. embeds [T, H] -> (embeds, re-fed rows)."""
        if embeds.shape[0] <= self.num_reqs:  # one token per request: the feedback covers them, no host sync
            return embeds, 0
        slots.settle()  # the rows recorded so far are re-fed
        qsl, index, codes, refed = self.qsl.tolist(), [], [], 0
        for i, rid in enumerate(self.req_ids):
            start, end = qsl[i], qsl[i + 1]
            if end - start <= 1:  # a decode step: the feedback covers it
                continue
            req = slots.requests.get(rid)
            sources = [reference_rows(infos, slots.store.num_codebooks, i, self.span(start, end), req)]
            if req is not None and req.rows:
                first = int(slots.seed_pos[req.slot]) + 1
                sources.append((torch.arange(first, first + len(req.rows)), torch.cat(req.rows)))
            for k, src in enumerate(sources):
                if src is not None:
                    tok, got = rows_at(self.positions[start:end], *src)
                    index.append(tok + start)
                    codes.append(got.to(embeds.device, torch.long))  # reference rows may sit elsewhere than ours
                    refed += int(tok.numel()) if k else 0
        if not index:
            return embeds, 0
        return embed_rows(embeds, torch.cat(index), torch.cat(codes), embedding), refed


class StepBuffers:
    """A step's per-token inputs in fixed storage, for steps of up to ``capacity`` tokens: each token's feedback
    (``use`` [S] bool, ``codes`` [S, C] int64) and copies of the step's ``input_ids`` / ``positions`` [S] int64.
    A graph captured over the forward (vLLM's FULL decode graph) holds these very tensors: a replay reads the
    feedback written before it and refreshes the token copies while no Python of ours runs."""

    def __init__(self, capacity: int, num_codebooks: int, device: torch.device) -> None:
        self.capacity = capacity
        self.use = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.codes = torch.zeros(capacity, num_codebooks, dtype=torch.long, device=device)
        self.input_ids = torch.zeros(capacity, dtype=torch.long, device=device)
        self.positions = torch.zeros(capacity, dtype=torch.long, device=device)

    def clear(self) -> None:
        """No feedback this step (a dummy run, or a step whose spans are unknown)."""
        self.use.zero_()

    def write_feedback(self, step: SpanStep, slots: RequestSlots, num_tokens: int) -> None:
        """The feedback of a step of ``num_tokens`` tokens, before its forward; a step larger than the buffers is
        fed on its tails by ``feed`` instead."""
        if num_tokens <= self.capacity:
            step.write_feedback(slots, self.use, self.codes)

    def lay_out(
        self, step: SpanStep, slots: RequestSlots, input_ids: Tensor, positions: Tensor, qsl: Tensor
    ) -> SpanStep:
        """The step's token layout is known: ``step.lay_out`` (its slots, new requests getting one, and spans) and its
        feedback written here. Returns the step."""
        step.lay_out(slots, input_ids, positions, qsl)
        self.write_feedback(step, slots, input_ids.shape[0])
        return step

    def write_decode_feedback(self, slots: RequestSlots, req_ids: list[str], step_slots: Tensor) -> None:
        """The feedback of a pure decode step (token i = request i) of ``req_ids`` in ``step_slots`` [B]."""
        qsl = torch.arange(len(req_ids) + 1, device=step_slots.device)
        self.write_feedback(SpanStep(req_ids, slots=step_slots, qsl=qsl, one_token_each=True), slots, len(req_ids))

    def keep_tokens(self, input_ids: Tensor, positions: Tensor) -> None:
        """Copy the step's tokens and positions [T] (in the forward: a captured graph refreshes them on replay)."""
        t = positions.shape[0]
        if t <= self.capacity:
            self.input_ids[:t].copy_(input_ids)
            self.positions[:t].copy_(positions)

    def decode_layout(self, num_reqs: int) -> tuple[Tensor, Tensor, Tensor]:
        """(input_ids, positions, qsl) of a pure decode step of ``num_reqs`` requests (one token each, in batch
        order) as the token copies hold it: a replayed graph refreshed them without our forward."""
        qsl = torch.arange(num_reqs + 1, device=self.input_ids.device)
        return self.input_ids[:num_reqs], self.positions[:num_reqs], qsl

    def embed_codes(
        self, embeds: Tensor, embedding, slots: RequestSlots, step: SpanStep | None, infos: list | None = None
    ) -> tuple[Tensor, int]:
        """embeds [T, H] -> (embeds with the step's code rows, rows re-fed): its multi-token spans' reference and
        re-fed rows (``prompt_rows`` of ``infos``, else the step's own references), then every token's feedback."""
        refed = 0
        if step is not None:
            embeds, refed = step.prompt_rows(slots, infos or step.references or [], embeds, embedding)
        if refed:
            logger.info("higgs talker: %d rows fed again to requests recomputed after a preemption", refed)
        return self.feed(embeds, embedding, slots, step), refed

    def feed(self, embeds: Tensor, embedding, slots: RequestSlots, step: SpanStep | None) -> Tensor:
        """embeds [T, H] -> [T, H] with each token's feedback: from the buffers whenever T fits (in dummy runs too,
        so that a graph captured there contains it), else on the tails of ``step``."""
        t = embeds.shape[0]
        if t <= self.capacity:
            return feed_back(embeds, self.use[:t], self.codes[:t], embedding)
        return embeds if step is None else step.feed_tails(slots, embeds, embedding)


def row_modes(
    slots: RequestSlots, step_slots: Tensor, tail_ids: Tensor, tail_pos: Tensor, audio_id: int, eos_id: int
) -> RowModes:
    """Classify a step's rows from their tail tokens and positions [B] and the pooled state of ``step_slots`` [B]
    (no host sync). A stream row is due only when its tail sits at the position of its next frame (``seed_pos +
    rows produced``), so a partial prefill chunk (whose output vLLM discards) never advances a stream."""
    state = slots.store.state
    active, done = state.has_codes.index_select(0, step_slots), state.done.index_select(0, step_slots)
    opens = tail_ids == audio_id
    seed = opens & ~active & ~done
    due = tail_pos == slots.seed_pos.index_select(0, step_slots) + slots.store.num_rows.index_select(0, step_slots)
    forced = forced_text_tokens(done, audio_id, eos_id)
    return RowModes(seed, done, opens | active | done, (seed | (active & due)) & ~done, forced)


def frame_results(
    slots: RequestSlots,
    head,
    step_slots: Tensor,
    hidden: Tensor,
    tail_ids: Tensor,
    tail_pos: Tensor,
    params: tuple,
    *,
    audio_id: int,
    eos_id: int,
) -> Tensor:
    """One step's frame work on the device (graph-safe: no host sync): the rows are classified (``row_modes``),
    seed rows open a fresh stream (remembering where: ``tail_pos``), done rows close theirs, rows due a frame
    produce one; the slots ``step_slots`` [B] advance in place. hidden [B, H]; tail_ids, tail_pos [B] int64; params
    (temperature, top_k, top_p) as a front end has them (``row_params``). Returns the results [B, C + 3] int32 that
    ``RequestSlots.record`` reads: the emitted row, then the valid, active and done flags."""
    modes = row_modes(slots, step_slots, tail_ids, tail_pos, audio_id, eos_id)
    params = row_params(step_slots.shape[0], hidden.device, *params)
    seed_pos = torch.where(modes.seed, tail_pos, slots.seed_pos.index_select(0, step_slots))
    slots.seed_pos.index_copy_(0, step_slots, seed_pos)
    logits = head(hidden).float()  # [B, C, V]
    fresh = modes.seed | modes.done
    emitted, new = sample_frame(slots.store, step_slots, logits, params=params, active=modes.code_rows, fresh=fresh)
    flags = (modes.code_rows[:, None], new.has_codes[:, None], new.done[:, None])
    return torch.cat([emitted, *flags], dim=1).to(torch.int32)


def rows_or_empty(rows: list, num_codebooks: int) -> list[Tensor]:
    """Per request its code rows [R, C] as a runner passes them on: a non-empty tensor as it is, anything else
    (None, no rows) as one shared empty [0, C] int32."""
    empty = torch.zeros(0, num_codebooks, dtype=torch.int32)
    return [r if isinstance(r, Tensor) and r.numel() else empty for r in rows]


def reference_rows(
    infos: list,
    num_codebooks: int,
    i: int,
    span: tuple[Tensor, Tensor] | None = None,
    req: HostRequest | None = None,
) -> tuple[Tensor, Tensor] | None:
    """(placeholder positions [R] int64, reference rows [R, C] int64) of request i's voice-clone info, or None.

    An info is vllm-omni's per-request dict (the bridge builds the same): ``audio_input_ids`` [R, C] (or a
    one-element list of it), optionally ``audio_input_ids_mask`` [R] bool (the rows to keep) and
    ``audio_placeholder_positions`` [R] (vllm-omni 0.30, the bridge). Without positions (vllm-omni 0.26) the
    prompt marks the rows with ``PLACEHOLDER`` tokens: ``placeholder_positions`` finds them in ``span``, the
    request's scheduled (input_ids, positions), keeping what it learns on ``req``. Rows and positions
    that do not pair up are skipped rather than placed at a guess.
    """
    info = infos[i] if i < len(infos) else None
    if not isinstance(info, dict) or info.get("audio_input_ids") is None:
        return None
    codes, where, mask = (_unwrapped(info.get(k)) for k in ("audio_input_ids", "audio_placeholder_positions",
                                                             "audio_input_ids_mask"))  # fmt: skip
    codes = torch.as_tensor(codes).reshape(-1, num_codebooks).long()
    mask = None if mask is None else torch.as_tensor(mask).reshape(-1).bool()
    if where is None:
        codes = codes if mask is None else codes[mask.to(codes.device)]
        where = None if span is None else placeholder_positions(*span, codes.shape[0], req)
        return None if where is None else (where, codes)
    where = torch.as_tensor(where).reshape(-1).long()
    if mask is not None:
        codes, where = codes[mask.to(codes.device)], where[mask.to(where.device)]
    if where.numel() != codes.shape[0]:
        logger.debug("reference rows (%d) and placeholder positions (%d) differ: skipped", len(codes), len(where))
        return None
    return where, codes


def _unwrapped(value):
    """A runner's per-request tensor, which serialization may have wrapped in a one-element list."""
    return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], Tensor) else value


PLACEHOLDER = -100  # the token id that stands for a reference row in vllm-omni 0.26's voice-clone prompts


def placeholder_positions(input_ids: Tensor, positions: Tensor, count: int, req: HostRequest | None) -> Tensor | None:
    """Prompt positions [count] of a voice clone's rows where its prompt marks them with ``PLACEHOLDER`` tokens,
    from one scheduled span of the request (input_ids, positions [S]), or None where the span shows none.

    The placeholders are one run and row j sits at the run's start + j. A prefill runs in prompt order, so the
    first span with a placeholder holds the run's start unless a prefix-cache hit skipped it: the start is that
    span's first placeholder when a token comes before it (in the span, or last in the request's previous span),
    else it is counted back from the run's end (a token after it in the span). ``req`` keeps the start for the
    request's later chunks (and a recompute after a preemption), and each span's last token. A span of
    placeholders only whose start is unknown places nothing, with a warning.
    """
    if req is not None and req.reference_start is not None:
        return torch.arange(req.reference_start, req.reference_start + count)
    before = None if req is None else req.prompt_tail
    if req is not None:
        req.prompt_tail = int(input_ids[-1])
    tok = torch.nonzero(input_ids == PLACEHOLDER).flatten().tolist()
    if not tok:
        return None
    if tok[0] > 0 or before not in (None, PLACEHOLDER):
        start = int(positions[tok[0]])
    elif tok[-1] + 1 < input_ids.shape[0]:
        start = int(positions[tok[-1]]) - count + 1
    else:
        logger.warning("a chunk of voice-clone placeholders shows neither end of their run: rows not placed")
        return None
    if req is not None:
        req.reference_start = start
    return torch.arange(start, start + count)


def force_text_logits(logits: Tensor, modes: RowModes) -> Tensor:
    """Text logits [B, V]: audio-mode rows keep only their forced token's logit (others -inf), in place."""
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, modes.forced[:, None], True)
    return logits.masked_fill_(modes.audio[:, None] & ~keep, float("-inf"))


def forced_only_logits(forced: Tensor, vocab_size: int, dtype: torch.dtype) -> Tensor:
    """[B, V] logits with only each row's forced token (``forced`` [B] int64) finite (0): no text head."""
    out = torch.full((forced.shape[0], vocab_size), float("-inf"), dtype=dtype, device=forced.device)
    return out.scatter_(1, forced[:, None], 0.0)


def decodes_first_qsl(
    num_reqs: int,
    positions: Tensor,
    num_decodes: int | None = None,
    num_prefills: int | None = None,
    prefill_qsl: Tensor | None = None,
) -> Tensor | None:
    """qsl [num_reqs + 1] int64 of a step whose tokens (positions [T]) hold the decodes first, one token each,
    then the prefills (FlashInfer's order); None where the spans cannot be known.

    The prefill spans come from ``prefill_qsl [num_prefills + 1]`` when given, else a single prefill takes every
    token left, else the position jumps split them, accepted only when they give exactly ``num_prefills`` spans.
    Counts that are missing or do not add up to ``num_reqs`` make every request a prefill of unknown length.
    """
    dev, n_tokens = positions.device, positions.shape[0]
    if not (isinstance(num_decodes, int) and isinstance(num_prefills, int) and num_decodes + num_prefills == num_reqs):
        num_decodes, num_prefills = 0, num_reqs
    decodes = torch.arange(num_decodes + 1, device=dev, dtype=torch.long)
    if num_prefills == 0:
        return decodes
    if prefill_qsl is not None and prefill_qsl.shape[0] == num_prefills + 1:
        return torch.cat([decodes, num_decodes + prefill_qsl[1:].to(dev, torch.long)])
    if num_prefills == 1:
        return torch.cat([decodes, torch.tensor([n_tokens], device=dev)])
    pos = positions[num_decodes:].long()
    starts = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1 + num_decodes).tolist()  # a host sync (prefills)
    if len(starts) + 1 == num_prefills:
        return torch.cat([decodes, torch.tensor([*starts, n_tokens], device=dev, dtype=torch.long)])
    return None
