"""The host side of the engine: requests, admission, preemption, KV blocks, decode-state slots, publishing.

Nothing here touches a device. ``schedule()`` turns the queue into the next ``StepBatch``: a prefill of newly
admitted (or resumed) requests, else a decode step of every running request (one token each). After the model
runner has executed it, ``publish(rows)`` records each request's row (an owned ``[1, C]`` int32 row per request
and step) and finishes the requests that ended; ``abort(exc)`` fails them instead when the step raised.

Asynchronous scheduling: while a step runs (a decode or a prefill), ``schedule_ahead()`` schedules the step
after it before its rows are known, so the device never waits for the host: a prefill of the waiting requests
that can be admitted now (admission needs free blocks and slots only), else a decode in which every request
goes one position further, except those the running step certainly ends (row or context limit); a request that
ends there by EOC, or is cancelled, is skipped when the step ahead is published (its extra row is dropped).
Steps are published in the order they were scheduled. A preemption needs the published state, so it waits
until no step runs ahead.

A request keeps its decode-state slot from admission to its end. When the KV cache runs out during decode, the
most recently admitted request is preempted: its blocks are freed and it is re-queued; on resume its prompt and
every generated position (each embedded from the row fed back there) are recomputed in one prefill, so its
codes do not change.

Prefix caching (``EngineConfig.prefix_caching``, off by default): once a prefill is published, each full block
of its prompt is registered under a hash of the prompt up to that block's end (token ids and reference codes,
``kv_cache.prefix_hashes``). A later prompt that starts the same way holds those blocks too and prefills only
the rest (at least its last token, which the first row is sampled from). Cached blocks nobody holds count as
free and are evicted least recently freed first. Prompt blocks are never written after their prefill (decode
writes after the prompt), so sharing them is safe; the codes are those of a full prefill up to floating-point
reduction order (the cached K/V were computed in another batch).
"""

from __future__ import annotations

import itertools
import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import Tensor

from .batch import StepBatch
from .config import TalkerConfig
from .heads.codebooks import rows_at
from .heads.sampling import SamplingParams
from .heads.slots import FreeList, SlotInit
from .kv_cache import BlockAllocator, kv_slot, prefix_hashes, slot_mapping
from .prompt import Prompt, PromptTooLong, validate_prompt


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    id: str
    prompt: Prompt
    params: SamplingParams
    seed: int
    max_rows: int  # delayed rows at most: max_frames audio frames plus the delay pattern's C rows
    status: Status = Status.WAITING
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    rows: list[Tensor] = field(default_factory=list)  # emitted delayed rows, each [C] int32 (CPU)
    finish_reason: str | None = None
    error: BaseException | None = None  # why a step failed this request (finish_reason "error")
    submitted_at: float = 0.0
    first_row_at: float | None = None
    finished_at: float | None = None
    prefill_ms: float = 0.0  # scheduled -> published, summed over its prefills (async: with the step queued before it)
    preemptions: int = 0
    num_cached: int = 0  # prompt tokens of its latest prefill whose K/V came from the prefix cache
    cached_tokens: int = 0  # the same, summed over its prefills (a preempted request is prefilled again)
    prefix_hashes: list[bytes] | None = None  # one per full prompt block (prefix caching), computed on admission

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence so far: the prompt plus one per emitted row after the first."""
        return len(self.prompt) + max(len(self.rows) - 1, 0)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class StepOutput:
    """One request's result of one step: the row it just produced (owned), and whether it finished."""

    request_id: str
    row: Tensor | None  # [1, C] int32 CPU, or None when the step produced no row
    finished: bool
    finish_reason: str | None = None


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64
    block_size: int = 16
    num_blocks: int | None = None  # None: what kv_memory_fraction of the free memory holds, at most enough
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_prefill_tokens: int = 8192
    kv_memory_fraction: float = 0.6  # share of the free device (CUDA) or host (CPU) memory the KV cache may take
    async_scheduling: bool | None = None  # queue decode t + 1 before publishing t (engine docstring); None: on CUDA
    prefix_caching: bool = False  # reuse the K/V of full prompt blocks another request computed (module docstring)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_prefill_tokens", "num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is None and name in ("num_blocks", "max_model_len"):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"{name} must be an integer > 0, got {value!r}")
            object.__setattr__(self, name, int(value))  # a numpy integer as a plain int
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {self.prefix_caching!r}")
        f = self.kv_memory_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 0.95:
            raise ValueError(f"kv_memory_fraction must lie in (0, 0.95], got {f!r}")

    def model_len(self, cfg: TalkerConfig) -> int:
        """The longest sequence (prompt and rows) the engine serves: ``max_model_len``, at most the checkpoint's
        positions (a longer one is refused, naming both, as vLLM does, rather than cut down unsaid)."""
        limit = cfg.text.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} is over the checkpoint's text_config.max_position_embeddings "
                f"({limit})"
            )
        return self.max_model_len or limit


class Scheduler:
    def __init__(self, config: EngineConfig, cfg: TalkerConfig, *, num_blocks: int, max_model_len: int) -> None:
        self.config, self.cfg, self.max_model_len = config, cfg, max_model_len
        self.blocks = BlockAllocator(num_blocks, config.block_size)
        self.free_slots = FreeList(config.max_num_seqs)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        # scheduled steps not yet published, oldest first (two while a decode runs ahead): each step's requests
        # in row order, and the host time a prefill began (None: a decode)
        self._unpublished: deque[tuple[list[Request], float | None]] = deque()

    # ------------------------------------------------------------------ requests

    def add(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt; returns its request id. Raises for a bad prompt or one that can never fit."""
        validate_prompt(prompt, self.cfg)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.check_lengths()
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self.requests)
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_fits(prompt, params.min_frames)
        seed = params.resolved_seed()
        max_rows = params.max_frames + self.cfg.num_codebooks
        req = Request(request_id, prompt, params, seed, max_rows, submitted_at=time.perf_counter())
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def check_fits(self, prompt: Prompt, min_frames: int = 0) -> None:
        """PromptTooLong unless ``prompt`` leaves room for a row, and for ``min_frames`` audio frames, within
        max_model_len and the KV cache (``add`` checks it; ``HiggsTalker.prepare`` checks it before anything is
        queued)."""
        if len(prompt) + 1 > self.max_model_len:
            raise PromptTooLong(
                f"prompt of {len(prompt)} tokens leaves no room within max_model_len={self.max_model_len}"
            )
        # a request is cut once its prompt and rows fill max_model_len: its rows, less the ramp-up, are frames
        room = self.max_model_len - len(prompt) - (self.cfg.num_codebooks - 1)
        if min_frames > max(room, 0):
            raise PromptTooLong(
                f"min_frames={min_frames} cannot be reached: the prompt of {len(prompt)} tokens leaves room for "
                f"{max(room, 0)} audio frames within max_model_len={self.max_model_len}"
            )
        if self.blocks.blocks_for(len(prompt) + 1) > self.blocks.num_blocks:
            raise PromptTooLong(
                f"prompt of {len(prompt)} tokens does not fit the KV cache ({self.blocks.num_blocks} blocks)"
            )
        # the K/V of the prompt and of every row fed back until the min_frames-th frame is final: a request that
        # cannot hold them even alone would run until the cache is full and then fail
        need = self.blocks.blocks_for(len(prompt) + min_frames + self.cfg.num_codebooks - 1) if min_frames else 0
        if need > self.blocks.num_blocks:
            raise PromptTooLong(
                f"min_frames={min_frames} cannot be reached: the prompt of {len(prompt)} tokens and its rows need "
                f"{need} KV blocks, the cache has {self.blocks.num_blocks}"
            )

    def cancel(self, request_id: str) -> bool:
        """Stop a request now, freeing its KV blocks and slot. Returns False if it was not live."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "cancelled")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_finished(self, request_id: str) -> Request:
        """Forget a finished request and return it (its rows and timings)."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id!r}")
        if not req.finished:
            raise ValueError(f"request {request_id!r} has not finished")
        return self.requests.pop(request_id)

    # ------------------------------------------------------------------ scheduling

    def schedule(self, outputs: list[StepOutput]) -> StepBatch | None:
        """The next step's batch (None: nothing to run). Requests that end without running (their context is
        full) are finished here and reported in ``outputs``."""
        prefill = self._admit()
        if prefill:
            self._unpublished.append((prefill, time.perf_counter()))
            return self._prefill_batch(prefill)
        running = self._grow_running(outputs)
        if not running:
            return None
        self._unpublished.append((running, None))
        return self._decode_batch(running)

    def schedule_ahead(self) -> StepBatch | None:
        """The step after the one step not yet published (a prefill or a decode), scheduled before its rows are
        known (see the module docstring); None when it cannot be: two steps are unpublished, no request is
        sure to go on, or one needs a KV block when none is free.

        A prefill when a waiting request can be admitted (admission needs only free blocks and slots), else the
        decode that ``schedule()`` would give once the running step is published: every running request, those
        it prefills at their first decode position."""
        if len(self._unpublished) != 1:
            return None
        if self._admissible():
            prefill = self._admit()
            self._unpublished.append((prefill, time.perf_counter()))
            return self._prefill_batch(prefill)
        current, started = self._unpublished[0]
        in_flight = {id(r) for r in current}
        batch, positions = [], []
        for req in self.running:
            if req.status is not Status.RUNNING:
                continue
            if id(req) not in in_flight:  # published: its limits were checked then
                pos = req.num_computed
            elif self._limit_reason(req, len(req.rows) + 1) is not None:
                continue  # the running step certainly ends it
            else:
                pos = self._prefill_tokens(req) if started is not None else req.num_computed + 1
            batch.append(req)
            positions.append(pos)
        bs = self.config.block_size
        for req, pos in zip(batch, positions, strict=True):  # room for the token at pos
            if len(req.blocks) * bs < pos + 1:
                if not self.blocks.can_allocate(1):
                    return None  # preemption needs the published state: schedule after publishing
                req.blocks += self.blocks.allocate(1)
        if not batch:
            return None
        self._unpublished.append((batch, None))
        return self._decode_batch(batch, positions)

    def _prefill_tokens(self, req: Request) -> int:
        return len(req.prompt) + len(req.rows)  # a resumed request recomputes every fed position

    def _cache_hits(self, req: Request) -> list[int]:
        """The cached blocks of ``req``'s prompt prefix (prefix caching), at most all but its last token's."""
        if not self.config.prefix_caching:
            return []
        bs = self.config.block_size
        if req.prefix_hashes is None:
            req.prefix_hashes = prefix_hashes(req.prompt, bs)
        return self.blocks.lookup(req.prefix_hashes[: (len(req.prompt) - 1) // bs])

    def _admission(self) -> list[int] | None:
        """The cached blocks the first waiting request would share if it can be admitted now, else None."""
        if not self.waiting:
            return None
        req = self.waiting[0]
        if req.slot < 0 and not self.free_slots.num_free:
            return None
        hits = self._cache_hits(req)
        unheld = sum(self.blocks.refs(b) == 0 for b in hits)  # cached blocks that count as free until shared
        need = self.blocks.blocks_for(self._prefill_tokens(req) + 1) - len(hits)
        return hits if self.blocks.can_allocate(need + unheld) else None

    def _admissible(self) -> bool:
        """Whether the first waiting request could be admitted now."""
        return self._admission() is not None

    def _admit(self) -> list[Request]:
        batch, tokens, bs = [], 0, self.config.block_size
        while (hits := self._admission()) is not None:
            req = self.waiting[0]
            n = self._prefill_tokens(req)
            if batch and tokens + n - len(hits) * bs > self.config.max_prefill_tokens:
                break
            self.waiting.popleft()
            self.blocks.share(hits)
            req.blocks = hits + self.blocks.allocate(self.blocks.blocks_for(n + 1) - len(hits))  # + the first decode
            req.num_cached = len(hits) * bs
            req.cached_tokens += req.num_cached
            if req.slot < 0:
                req.slot = self.free_slots.acquire()
            req.status = Status.RUNNING
            batch.append(req)
            tokens += n - req.num_cached
        if not batch and self.waiting and not self.running:
            req = self.waiting.popleft()
            self._finish(req, "error")  # it can never fit: fail it once instead of blocking every later step
            req.error = RuntimeError(
                f"request {req.id!r} needs {self.blocks.blocks_for(len(req.prompt) + len(req.rows) + 1)} KV blocks "
                f"but the cache has {self.blocks.num_blocks} in all; raise num_blocks or lower max_frames"
            )
            raise req.error
        self.running += batch
        return batch

    def _grow_running(self, outputs: list[StepOutput]) -> list[Request]:
        """Give every running request room for one more token, preempting the newest when blocks run out."""
        bs = self.config.block_size
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue
            if req.num_computed + 1 > self.max_model_len:
                self._finish(req, "max_model_len")
                outputs.append(StepOutput(req.id, None, True, "max_model_len"))
                continue
            while len(req.blocks) * bs < req.num_computed + 1:
                if self.blocks.can_allocate(1):
                    req.blocks += self.blocks.allocate(1)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
        return [r for r in self.running if r.status is Status.RUNNING]

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req.blocks)
        req.blocks, req.num_computed = [], 0
        req.status = Status.WAITING
        req.preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _sampling_flags(self, batch: list[Request]) -> tuple[bool, bool]:
        """(draw, filter) from host-side params: lets eager steps skip work no row needs.

        Exact: an inactive top-k/top-p filter masks nothing, and greedy rows take the argmax either way.
        Full-decode graphs have one variant per combination (``cuda_graphs.full_decode``); the one with both on
        serves any batch.
        """
        v = self.cfg.codebook_size
        sampled = [r.params for r in batch if r.params.temperature > 0]
        return bool(sampled), any(0 < p.top_k < v or p.top_p < 1 for p in sampled)

    def _prefill_batch(self, batch: list[Request]) -> StepBatch:
        bs, audio = self.config.block_size, None
        token_ids, positions, slots_kv, audio_index, codes, query_lens, lens, new = [], [], [], [], [], [], [], []
        for req in batch:
            p, start, cached = req.prompt, len(token_ids), req.num_cached  # positions [cached, n) are computed
            n = len(p) + len(req.rows)
            audio = audio if audio is not None else int(p.input_ids[-1])  # any valid id: the embedding is replaced
            token_ids += p.input_ids[cached:].tolist() + [audio] * len(req.rows)
            positions += range(cached, n)
            slots_kv += slot_mapping(req.blocks, cached, n, bs)
            span = torch.arange(cached, n)
            for where, rows in _code_rows(p, req.rows):
                tok, got = rows_at(span, where, rows)
                if tok.numel():
                    audio_index += (tok + start).tolist()
                    codes.append(got.long())
            if not req.rows:  # a first prefill (a preempted request has rows): its stream starts now
                new.append(self._slot_init(req))
            query_lens.append(n - cached)
            lens.append(n)
        draw, filter = self._sampling_flags(batch)
        return StepBatch(
            slots=[r.slot for r in batch],
            positions=positions,
            slot_mapping=slots_kv,
            query_lens=query_lens,
            seq_lens=lens,
            block_tables=[list(r.blocks) for r in batch],
            token_ids=token_ids,
            audio_index=audio_index,
            audio_codes=torch.cat(codes) if codes else None,
            new_slots=tuple(new),
            draw=draw,
            filter=filter,
        )

    def _slot_init(self, req: Request) -> SlotInit:
        p = req.params
        return SlotInit(req.slot, req.seed, float(p.temperature), p.top_k, float(p.top_p), p.min_frames)

    def _decode_batch(self, batch: list[Request], positions: list[int] | None = None) -> StepBatch:
        """One token per request at its next position (``positions``: given when steps before it are not yet
        published; by default each request's ``num_computed``)."""
        bs = self.config.block_size
        draw, filter = self._sampling_flags(batch)
        pos = [r.num_computed for r in batch] if positions is None else positions
        return StepBatch(
            slots=[r.slot for r in batch],
            positions=pos,
            slot_mapping=[kv_slot(r.blocks, p, bs) for r, p in zip(batch, pos, strict=True)],
            query_lens=[1] * len(batch),
            seq_lens=[p + 1 for p in pos],
            block_tables=[r.blocks for r in batch],
            draw=draw,
            filter=filter,
        )

    # ------------------------------------------------------------------ results

    def publish(self, rows: Tensor) -> list[StepOutput]:
        """rows [B, C + 1] int CPU (codes + done flag) of the oldest unpublished step -> one output per request
        that is still live (a request cancelled, or ended by the step before, is skipped)."""
        batch, started = self._unpublished.popleft()
        with torch.inference_mode(False):  # ordinary tensors, which callers may modify
            host = rows.to(torch.int32)
            codes, done = host[:, :-1], host[:, -1].tolist()
            published = codes.clone().split(1)  # [1, C] each; not shared with req.rows, so callers may modify them
            kept = codes.unbind(0)  # [C] each, one call instead of B indexing ops
        now = time.perf_counter()
        prefill = started is not None
        prefill_ms = (now - started) * 1e3 if prefill else 0.0
        outputs = []
        for i, req in enumerate(batch):
            if req.finished:
                continue
            req.num_computed = len(req.prompt) + len(req.rows) if prefill else req.num_computed + 1
            if prefill and req.prefix_hashes is not None:  # its full prompt blocks now hold their K/V
                first = req.num_cached // self.config.block_size
                for block, h in zip(req.blocks[first:], req.prefix_hashes[first:], strict=False):
                    self.blocks.register(block, h)
            req.prefill_ms += prefill_ms
            req.rows.append(kept[i])
            if req.first_row_at is None:
                req.first_row_at = now
            reason = "eoc" if done[i] else self._limit_reason(req, len(req.rows))
            if reason:
                self._finish(req, reason)
            outputs.append(StepOutput(req.id, published[i], reason is not None, reason))
        return outputs

    def _limit_reason(self, req: Request, rows: int) -> str | None:
        """Why ``req`` ends once it has ``rows`` rows, short of EOC: its row limit or its context limit."""
        if rows >= req.max_rows:
            return "max_frames"
        if len(req.prompt) + max(rows - 1, 0) + 1 > self.max_model_len:  # its tokens then, plus the next one
            return "max_model_len"
        return None

    def abort(self, exc: BaseException) -> list[StepOutput]:
        """The oldest unpublished step raised: its requests' KV and state may be half-written, so they end with
        ``exc`` (nothing, if no step is unpublished)."""
        if not self._unpublished:
            return []
        batch, _ = self._unpublished.popleft()
        live = [r for r in batch if not r.finished]
        for req in live:
            self._finish(req, "error")
            req.error = exc
        return [StepOutput(r.id, None, True, "error") for r in live]

    def abort_all(self, exc: BaseException) -> None:
        """``abort`` every unpublished step (the device failed under them)."""
        while self._unpublished:
            self.abort(exc)

    def discard_finished(self) -> bool:
        """Forget the newest unpublished step if none of its requests is live (its rows will never be read)."""
        if self._unpublished and all(r.finished for r in self._unpublished[-1][0]):
            self._unpublished.pop()
            return True
        return False

    def _finish(self, req: Request, reason: str) -> None:
        if req.blocks:
            self.blocks.free(req.blocks)
        req.blocks = []
        if req.slot >= 0:
            self.free_slots.release(req.slot)
            req.slot = -1
        if req in self.running:
            self.running.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finished_at = time.perf_counter()


def _code_rows(prompt: Prompt, fed: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """(positions [R], rows [R, C]) a prefill embeds from codes: the reference rows at their placeholders and,
    on resume after a preemption, row j fed back at position len(prompt) + j."""
    out = [] if prompt.audio_codes is None else [(prompt.audio_positions, prompt.audio_codes)]
    if fed:
        out.append((torch.arange(len(prompt), len(prompt) + len(fed)), torch.stack(fed)))
    return out
