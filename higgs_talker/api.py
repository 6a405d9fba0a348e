"""The direct Python API: load a checkpoint, generate or stream codes, batch many requests.

Threads: one ``HiggsTalker`` may be shared. ``generate`` and ``stream`` queue their requests on the talker's
engine and wait; a worker thread (started on demand, gone when idle) runs the steps, so concurrent callers'
requests are batched together and each caller gets exactly its own codes. An interrupt or error in one caller
(Ctrl-C in a ``stream`` loop, a ``progress`` callback that raises) cancels that caller's requests only, and
waits for the step in flight when no other caller needs the worker (so a program can exit right after). A step
that fails fails the requests it was running, and their callers raise ``GenerationError`` with the cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from . import checkpoint
from .audio import CodecLoader, has_bundled_codec
from .config import TalkerConfig, check_fits_device
from .cuda_graphs.buckets import normalize_buckets
from .cuda_graphs.choice_cache import open_choice_cache
from .cuda_graphs.policy import GraphMode
from .driver import Driver, Ticket
from .engine import Engine, EngineConfig, Request
from .flashinfer_attention import check_decode_kernel
from .heads.delay import aligned_frames, codec_frames
from .heads.sampling import SamplingParams, resolve_seed
from .model import TalkerModel
from .ops import check_row_gemv, default_kernels, rope_cache
from .prompt import Prompt, TalkerTokenizer
from .results import GenerationCancelled, GenerationError, GenerationResult, Reference
from .splitting import DEFAULT_PART_CHARS, frame_budget, split_text
from .tiny import TINY_NAME, tiny_checkpoint

__all__ = ["GenerationCancelled", "GenerationError", "GenerationResult", "HiggsTalker", "PreparedText", "Reference"]

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class HiggsTalker:
    """The talker: ``HiggsTalker.from_pretrained("tiny").generate("Hello")``."""

    def __init__(
        self,
        model: TalkerModel,
        cfg: TalkerConfig,
        tokenizer: TalkerTokenizer,
        engine_config: EngineConfig | None = None,
        *,
        graph_mode: GraphMode | str = GraphMode.EAGER,
        decode_kernel: str = "auto",
        buckets: Sequence[int] | None = None,
        prefill_buckets: Sequence[int] | None = None,
        codec_loader: CodecLoader | None = None,
        choice_cache: str | Path | bool | None = None,
    ) -> None:
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.codec_loader = codec_loader
        self.graph_mode = GraphMode.parse(graph_mode)
        self.engine = Engine(model, cfg, tokenizer.specials, engine_config, decode_kernel=decode_kernel)
        if self.engine.device.type == "cuda":
            self.engine.warm_up(self.graph_mode, buckets, prefill_buckets, choice_cache)
        self._driver = Driver(self.engine)
        self._audio = threading.Condition()  # guards _audio_streams: stream_audio calls decoding now
        self._audio_streams = 0

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path = TINY_NAME,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        *,
        graph_mode: str | None = None,
        decode_kernel: str = "auto",
        fuse_qk_rope: bool = True,
        row_gemv: str = "auto",
        buckets: Sequence[int] | None = None,
        prefill_buckets: Sequence[int] | None = None,
        codec: bool = True,
        audio_tokenizer: str | Path | None = None,
        codec_dtype: str | torch.dtype = torch.float32,
        choice_cache: str | Path | bool | None = None,
        **engine_options,
    ) -> HiggsTalker:
        """Load a checkpoint directory, or ``"tiny"`` for the embedded default.

        dtype defaults to float32 on CPU and bfloat16 on CUDA; ``graph_mode`` (eager, local_mlp, full_decode,
        auto) defaults to auto on CUDA, and CPU runs eager only. ``engine_options`` are ``EngineConfig``
        fields (max_num_seqs, block_size, num_blocks, max_model_len, max_prefill_tokens, kv_memory_fraction,
        async_scheduling, prefix_caching: requests whose prompts start the same way, the same reference voice
        included, share the K/V of those prompt blocks and prefill only the rest).
        ``fuse_qk_rope`` (CUDA with FlashInfer and triton; on by default, False for the separate kernels):
        QK-norm, RoPE and the K/V cache writes of each layer in one Triton kernel (H200: 7% off a batch-1 decode
        step; greedy codes equal to the separate kernels' up to bf16 near ties).
        ``row_gemv`` (CUDA with FlashInfer and triton): inputs of one row (decode at batch 1) and of 2 to 16 rows
        (decode of a few requests) of a linear take our Triton kernels (``triton_gemv``: a GEMV, and a 16-row
        tensor-core tile; gate_up with SiLU-and-mul after it) instead of cuBLAS: ``"auto"`` (default) where warm-up
        measured them correct and faster on this GPU (H200, 4B, one row: 15 us a layer less), ``"on"`` on every
        linear where they are correct (no timing: the same kernels on every start), ``"off"`` nowhere.

        ``buckets``: the decode batch sizes of CUDA graphs. ``prefill_buckets`` (default
        ``cuda_graphs.PREFILL_BUCKETS``; ``()`` turns them off): prefill token counts (with FlashInfer) that a
        prefill is padded up to, by the tokens it computes; modes full_decode and auto replay a whole-prefill
        graph per bucket (H200, 4B: a 32-token prefill step takes 4.5 ms replayed, 18.8 ms eagerly), a longer
        prefill runs unpadded. Both are checked on every device, before anything is loaded.

        ``choice_cache`` (CUDA): where warm-up keeps what it measured (the one-row GEMV tiles, each bucket's decode
        kernel and, in auto, graph path) for the next start with the same GPU, versions, shapes and options, which
        then checks those choices instead of timing them again (``cuda_graphs.choice_cache``): a directory, None
        for ``$HIGGS_TALKER_CHOICE_CACHE`` or ``~/.cache/higgs_talker/choices``, False for no cache.

        ``codec``: results carry ``audio`` decoded by the codec bundled in the checkpoint (when it has one),
        loaded on first use in ``codec_dtype`` on ``device``. ``audio_tokenizer``: an audio tokenizer directory
        (transformers' layout) that encodes ``Reference(audio=...)`` instead of the bundled encoder.
        """
        device, dtype, mode = _resolve_runtime(device, dtype, graph_mode)
        check_decode_kernel(decode_kernel)
        check_row_gemv(row_gemv)
        _check_buckets(buckets, prefill_buckets)
        open_choice_cache(choice_cache)  # a bad option fails here, before anything is loaded
        engine_config = _engine_config(engine_options)
        path, cfg, tokenizer, header = _checked_checkpoint(path, engine_config, device, dtype)
        loader = None
        if codec and (audio_tokenizer is not None or has_bundled_codec(path)):
            loader = CodecLoader(path, device, codec_dtype, tokenizer_path=audio_tokenizer, talker=cfg)
            loader.check_fit()  # from the codec's config: one that does not fit the talker fails before loading
        started = time.perf_counter()
        model = _empty_model(cfg, device, dtype, fuse_qk_rope, row_gemv)
        built = time.perf_counter()
        checkpoint.load_into(model, checkpoint.iter_tensors(path, cfg, device, dtype, header=header), cfg)
        model.eval().requires_grad_(False)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info("loaded %s on %s (%s, kernels=%s, fused QK-norm/RoPE: %s): model and kernels %.2f s, weights "
                    "(%.1f MB read, checked, copied) %.2f s", path, device, dtype, model.kernels.name,
                    model.kernels.fuse_qk_rope, built - started, nbytes / 1e6, time.perf_counter() - built)  # fmt: skip
        if loader is None and codec:
            logger.info("%s bundles no codec: results carry codes only", path)
        return cls(
            model, cfg, tokenizer, engine_config, graph_mode=mode, decode_kernel=decode_kernel, buckets=buckets,
            prefill_buckets=prefill_buckets, codec_loader=loader, choice_cache=choice_cache,
        )  # fmt: skip

    @classmethod
    def from_config(
        cls,
        cfg: TalkerConfig,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        *,
        seed: int = 0,
        tokenizer_path: str | Path | None = None,
        graph_mode: str | None = None,
        decode_kernel: str = "auto",
        fuse_qk_rope: bool = True,
        row_gemv: str = "auto",
        buckets: Sequence[int] | None = None,
        prefill_buckets: Sequence[int] | None = None,
        choice_cache: str | Path | bool | None = None,
        **engine_options,
    ) -> HiggsTalker:
        """A talker of any shape with random weights (benchmarks, tests); the tokenizer defaults to the tiny one.

        Weights are drawn on the device (normal, std 0.02; norms 1), so a 4B-shaped model builds in seconds.
        ``engine_options``, ``fuse_qk_rope``, ``row_gemv`` and ``choice_cache`` as for ``from_pretrained``.
        """
        device, dtype, mode = _resolve_runtime(device, dtype, graph_mode)
        check_decode_kernel(decode_kernel)
        check_row_gemv(row_gemv)
        _check_buckets(buckets, prefill_buckets)
        open_choice_cache(choice_cache)
        engine_config = _engine_config(engine_options)
        if not isinstance(cfg, TalkerConfig):
            raise TypeError(f"cfg must be a TalkerConfig, got {type(cfg).__name__}")
        engine_config.model_len(cfg)
        check_fits_device(cfg, device, dtype)  # before allocating: a huge config fails here, naming its size
        model = _empty_model(cfg, device, dtype, fuse_qk_rope, row_gemv)
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=g)
        model.eval().requires_grad_(False)
        tokenizer = TalkerTokenizer.from_pretrained(tokenizer_path or tiny_checkpoint(), cfg)
        return cls(
            model, cfg, tokenizer, engine_config, graph_mode=mode, decode_kernel=decode_kernel, buckets=buckets,
            prefill_buckets=prefill_buckets, choice_cache=choice_cache,
        )  # fmt: skip

    # ------------------------------------------------------------------ prompts

    @property
    def codec(self):
        """The codec that decodes this talker's codes (``higgs_talker.codec.Codec``), loaded on first use."""
        if self.codec_loader is None:
            raise ValueError(
                "this talker has no codec: load a checkpoint that bundles one with HiggsTalker.from_pretrained(..., "
                "codec=True)"
            )
        return self.codec_loader.decoder()

    def build_prompt(self, text: str, reference: Reference | None = None) -> Prompt:
        if reference is None:
            return self.tokenizer.build(text)
        if not isinstance(reference, Reference):
            raise TypeError(f"reference must be a Reference, got {type(reference).__name__}")
        codes = reference.codes
        if reference.audio is not None:
            if self.codec_loader is None:
                raise ValueError("Reference(audio=...) needs a codec to encode it; this talker has none")
            codes = self.codec_loader.reference_codes(reference.audio, reference.sample_rate)
        return self.tokenizer.build(text, codes, reference.text, self.cfg)

    def prepare(
        self,
        text: str,
        sampling: SamplingParams | None = None,
        reference: Reference | None = None,
        max_frames: int | None = None,
        split: bool | int = False,
    ) -> PreparedText:
        """Check, split and tokenize ``text`` once: ``stream`` and ``stream_audio`` take the result in place of the
        text and queue its prompts as they are (the speech server checks a request this way, then speaks it).

        Arguments as for ``stream``; with ``split``, the seed of all parts is drawn here when the sampling has none.
        """
        (params,) = self._params(sampling, 1, max_frames)
        return self._prepare(text, params, reference, split)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        text: str | Sequence[str],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        reference: Reference | None = None,
        max_frames: int | None = None,
        progress: Callable[[int], object] | None = None,
        split: bool | int = False,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate codes for one text (-> one result) or a list of texts batched together (-> a list).

        ``sampling`` may be one ``SamplingParams`` for all texts or one per text; ``max_frames`` (audio frames,
        25 per second) overrides its ``max_frames``. ``progress(rows_so_far)`` is called as steps complete.
        ``split`` (long input): True, or the most characters a part may hold (True: ``DEFAULT_PART_CHARS``),
        cuts each text at sentence ends into parts that are generated together, with the same voice and seed (a
        drawn one when the sampling has none), each capped at ``splitting.frame_budget`` frames of its text; the
        result joins their codes and rows in order (``result.parts`` holds each part's own result). With ``split``,
        ``min_frames`` and ``max_frames`` hold for each part, not for the joined result; a text that is one part
        is spoken as given, with no cap from its text.
        Raises ``GenerationError`` (with the cause) if a step fails one of these requests.
        """
        single = isinstance(text, str)
        if not single and (isinstance(text, bytes | bytearray) or not isinstance(text, Sequence)):
            raise TypeError(f"text must be a str or a list of str, got {type(text).__name__}: {text!r:.80}")
        texts = [text] if single else list(text)
        if not texts:
            raise ValueError("no text to generate")
        if progress is not None and not callable(progress):
            raise TypeError(f"progress must be a callable (rows so far) or None, got {type(progress).__name__}")
        params = self._params(sampling, len(texts), max_frames)
        prepared = [self._prepare(t, p, reference, split) for t, p in zip(texts, params, strict=True)]
        jobs = [(i, part) for i, p in enumerate(prepared) for part in p.parts]  # all checked before any is queued
        ids: list[str] = []
        eng = self.engine
        ticket = None
        try:
            for _, part in jobs:
                ids.append(eng.add_request(part.prompt, part.sampling))
            ticket = Ticket(ids, per_step=progress is not None)
            self._driver.wait_for(ticket)
            while not ticket.done:
                ticket.wait()
                if progress is not None:
                    progress(sum(len(eng.requests[i].rows) for i in ids))
            requests = [eng.pop_finished(i) for i in ids]
        except BaseException:
            self._forget(ids, ticket, settle=True)  # leave nothing of this call behind
            raise
        parts: list[list[GenerationResult]] = [[] for _ in texts]
        for req, (i, part) in zip(requests, jobs, strict=True):
            parts[i].append(self._result(req, part.text))
        results = [ps[0] if not split else self._joined(ps, t) for ps, t in zip(parts, texts, strict=True)]
        return results[0] if single else results

    def stream(
        self,
        text: str | PreparedText,
        sampling: SamplingParams | None = None,
        reference: Reference | None = None,
        max_frames: int | None = None,
        split: bool | int = False,
        cancel: threading.Event | None = None,
    ) -> Iterator[Tensor]:
        """Yield aligned frames [C] int64 as soon as each is final; together they equal ``generate().codes``.

        Frame t needs delayed rows up to t + C - 1; it is yielded once row t + C exists (so it is known not
        to be the trimmed last frame). Closing the iterator early cancels the request. ``split`` as for
        ``generate``: the parts' frames follow each other; the next part is queued when one starts, so it is
        generated alongside and its frames are ready when the previous part ends. ``text`` may be a
        ``PreparedText`` (``prepare``), given alone: it carries its sampling, voice, parts and prompts.
        ``cancel``: an event another thread may set (a client that left); it is checked before each frame and
        after every engine step, so a request still queued behind others is freed too (it makes no frame), and
        once it is set the requests are cancelled and freed and ``GenerationCancelled`` is raised.
        """
        _check_cancel_event(cancel)
        blocks = self._blocks(self._prepared(text, sampling, reference, max_frames, split), cancel)
        sent = 0
        try:
            for block in blocks:
                for frame in block:
                    _raise_if_cancelled(cancel, sent)
                    yield frame
                    sent += 1
        finally:
            blocks.close()  # a consumer that stops early cancels the requests before close() returns

    def _blocks(
        self, prepared: PreparedText, cancel: threading.Event | None, want: Callable[[], int] | None = None
    ) -> Iterator[Tensor]:
        """``stream``'s frames in blocks [k, C] int64, each of all the frames final since the last one; ``want()``
        (>= 1; default 1): how many new frames the caller needs before a block is of use to it (a codec chunk's),
        so it is woken only once they exist, or its requests end, or ``cancel`` is set."""
        parts = prepared.parts  # all checked before any is queued
        live: list[_Live] = []
        interrupted = True  # until the stream ends on its own: closed early, an error, Ctrl-C
        sent = 0  # frames yielded, over the parts
        try:
            for k in range(len(parts)):
                for j in range(len(live), min(k + 2, len(parts))):  # this part and the one after it
                    live.append(self._submit(parts[j].prompt, parts[j].sampling))
                for block in self._frames(live[k], cancel, sent, want):
                    yield block
                    sent += block.shape[0]
                self._forget([live[k].rid], live[k].ticket)
            interrupted = False
        finally:
            for lv in live:
                self._forget([lv.rid], lv.ticket, settle=interrupted)

    def _submit(self, prompt: Prompt, params: SamplingParams) -> _Live:
        rid = self.engine.add_request(prompt, params)
        lv = _Live(rid, self.engine.requests[rid], Ticket([rid], per_step=False))
        self._driver.wait_for(lv.ticket)
        return lv

    def _frames(
        self, lv: _Live, cancel: threading.Event | None, sent: int, want: Callable[[], int] | None
    ) -> Iterator[Tensor]:
        """The aligned frames of one submitted request in blocks [k, C] as they become final (see ``_blocks``);
        ``sent``: frames the stream yielded before this request's (for the cancel message)."""
        req, ticket = lv.req, lv.ticket
        ticket.cancel, ticket.per_step = cancel, True  # woken after steps from now on (``Ticket.due``), queued or not
        n, emitted, lists = self.cfg.num_codebooks, 0, []  # lists: the rows read so far, as lists of ints
        while True:
            # frame t is final once row t + n exists: the next block (frames up to need - 1) needs need + n rows
            need = emitted + max(1, want() if want is not None else 1)
            ticket.rearm(need + n)  # before the rows are read
            done = ticket.done  # read before the rows: every row of a done request is published by then
            final = len(req.rows) - n  # frames known final
            if final > emitted and (final >= need or done):
                _raise_if_cancelled(cancel, sent + emitted)
                # frames emitted .. final - 1 read rows emitted .. final + n - 2
                lists.extend(row.tolist() for row in req.rows[len(lists) : final + n - 1])
                yield aligned_frames(lists, emitted, final, self.cfg.num_real_codes)
                emitted = final
                continue
            if done:
                break
            ticket.wait()
            _raise_if_cancelled(cancel, sent + emitted)
        _raise_if_failed(req)
        rows = codec_frames(torch.stack(req.rows).long(), self.cfg.num_real_codes) if req.rows else None
        if rows is not None and emitted < rows.shape[0]:  # only the single-frame case is left here
            yield rows[emitted:]

    def _forget(self, ids: list[str], ticket: Ticket | None, settle: bool = False) -> None:
        """Cancel and drop this caller's requests (after an error, or when a stream is closed).

        ``settle`` (an exception is on its way out, Ctrl-C maybe): then wait for the worker thread to finish its
        step if no one else needs it (``Driver.settle``: the program may be about to exit), and let a second
        Ctrl-C restart this clean-up rather than cut it short; the exception that brought us here goes on after.
        """
        while True:
            try:
                if ticket is not None:
                    self._driver.withdraw(ticket)
                for i in ids:  # every step can be repeated
                    self.engine.cancel(i)
                    if i in self.engine.requests:
                        self.engine.pop_finished(i)
                if settle:
                    self._driver.settle()
                return
            except KeyboardInterrupt:
                if not settle:
                    raise

    def stream_audio(
        self,
        text: str | PreparedText,
        sampling: SamplingParams | None = None,
        reference: Reference | None = None,
        max_frames: int | None = None,
        chunking=None,
        split: bool | int = False,
        cancel: threading.Event | None = None,
    ) -> Iterator[Tensor]:
        """Yield 24 kHz waveform chunks [S] float32 (CPU) as frames complete; together they equal
        ``generate().audio`` up to float rounding under the default ``AudioChunking`` (exact context).

        ``chunking`` (``higgs_talker.codec.AudioChunking``) sets chunk sizes, left context and holdback;
        ``higgs_talker.codec.UPSTREAM_CHUNKING`` is vllm-omni's (lower latency, not exact). ``split`` as for
        ``generate``: the parts' frames go through one decoder, so the audio is one stream across the joins.
        ``text`` may be a ``PreparedText``, as for ``stream``.

        Closing the iterator early cancels the request (and a part queued ahead) and frees its decode slot and KV
        blocks before ``close()`` returns. ``cancel``, an event another thread may set (a client that left), does
        the same from outside, as for ``stream``: checked before each chunk's frames are decoded and after every
        engine step (a request queued behind others makes no frame), and once it is set the requests are cancelled
        and freed and ``GenerationCancelled`` is raised.

        The calling thread sleeps until the frames of its next chunk exist (``StreamingDecoder.frames_wanted``), the
        stream ends or ``cancel`` is set: one wake-up a chunk, not one a frame, so many streams leave the host to
        the engine's thread.
        """
        _check_cancel_event(cancel)
        decoder = self.codec.stream(chunking)  # a bad chunking fails here, before anything is queued
        self._capture_stream_graphs(decoder, wait=False)  # on first use, where the talker is idle
        with self._audio:
            self._audio_streams += 1
        try:
            prepared = self._prepared(text, sampling, reference, max_frames, split)
            blocks = self._blocks(prepared, cancel, want=decoder.frames_wanted)  # woken once a chunk's frames exist
            sent = 0
            try:
                for block in blocks:
                    while block.shape[0]:  # at most one chunk a push: a block may hold the frames of several
                        _raise_if_cancelled(cancel, sent)
                        wanted = decoder.frames_wanted()
                        piece, block = block[:wanted], block[wanted:]
                        chunk = decoder.push(piece)
                        sent += piece.shape[0]
                        if chunk is not None:
                            yield chunk.cpu()
            finally:
                blocks.close()  # a consumer that stops early cancels the request at once
            chunk = decoder.finish()
            if chunk is not None:
                yield chunk.cpu()
        finally:
            with self._audio:
                self._audio_streams -= 1
                self._audio.notify_all()

    def prepare_audio(self, chunking=None) -> dict | None:
        """Load the codec now and, on CUDA with graphs on (``graph_mode`` not eager), capture the decodes of the
        windows ``stream_audio`` cuts under ``chunking`` as CUDA graphs (``cuda_graphs.codec``), so that a first
        streamed request waits for neither. A capture needs the GPU to itself: this waits until the talker's
        requests and streams have ended, and takes no new one until it is done. ``stream_audio`` captures on
        first use too, where the talker is idle then. Returns the report of the shapes captured now ((batch,
        frames) -> what decodes it), or None where nothing is."""
        return self._capture_stream_graphs(self.codec.stream(chunking), wait=True)

    def _capture_stream_graphs(self, decoder, wait: bool) -> dict | None:
        """``prepare_audio``'s capture; ``wait``: for the talker to be idle, else none unless it is idle now."""
        if self.graph_mode is GraphMode.EAGER or decoder.codec.device.type != "cuda":
            return None
        from .codec.streaming import window_lengths
        from .cuda_graphs.codec import capture_stream_graphs, missing_stream_graphs

        lengths = window_lengths(decoder.rule)
        if not missing_stream_graphs(decoder.codec, lengths):
            return {}
        with self._audio:  # no stream starts meanwhile; then no request is taken (held_idle)
            while wait and self._audio_streams:
                self._audio.wait()
            if self._audio_streams:
                return None
            with self._driver.held_idle(wait) as idle:
                return capture_stream_graphs(decoder.codec, lengths) if idle else None

    def _prepared(
        self,
        text: str | PreparedText,
        sampling: SamplingParams | None,
        reference: Reference | None,
        max_frames: int | None,
        split: bool | int,
    ) -> PreparedText:
        """``text`` prepared, or a ``PreparedText`` as it is (nothing else may be given with it)."""
        if not isinstance(text, PreparedText):
            return self.prepare(text, sampling, reference, max_frames, split)
        given = {"sampling": sampling, "reference": reference, "max_frames": max_frames}
        extra = [name for name, value in given.items() if value is not None] + ([] if split is False else ["split"])
        if extra:
            raise ValueError(
                f"a PreparedText carries its own sampling, voice and parts; give it alone, not with {', '.join(extra)}"
            )
        return text

    def _prepare(
        self, text: str, params: SamplingParams, reference: Reference | None, split: bool | int
    ) -> PreparedText:
        """``text``'s parts with their sampling and their prompts, every prompt built and checked here (against
        the engine's max_model_len and KV cache too: ``PromptTooLong``, before anything is queued)."""
        parts = [PreparedPart(t, s, self.build_prompt(t, reference)) for t, s in self._parts(text, params, split)]
        for part in parts:
            self.engine.scheduler.check_fits(part.prompt, part.sampling.min_frames)
        return PreparedText(text, tuple(parts))

    def _parts(self, text: str, params: SamplingParams, split: bool | int) -> list[tuple[str, SamplingParams]]:
        """(text, sampling) of each part ``text`` is spoken in (one, unchanged, without ``split``)."""
        if split is False:
            return [(text, params)]
        if split is True:
            max_chars = DEFAULT_PART_CHARS
        elif isinstance(split, int) and split >= 1:
            max_chars = split
        else:
            raise ValueError(f"split must be True, False or the most characters a part holds (>= 1), got {split!r}")
        texts = split_text(text, max_chars) if isinstance(text, str) else []
        if len(texts) <= 1:
            # One part: the text and its sampling as given, no cap from the text (vllm-omni's speech endpoint
            # tokenizes its input verbatim, whitespace included, and caps it only by its token limit); empty or not
            # a string: build_prompt says what is wrong with it
            return [(text, params)]
        seed = resolve_seed(params.seed)  # one seed for every part
        out = []
        for t in texts:
            cap = min(params.max_frames, frame_budget(t.strip(), self.cfg.frame_rate))
            out.append((t, replace(params, seed=seed, max_frames=cap, min_frames=min(params.min_frames, cap))))
        return out

    def _joined(self, parts: list[GenerationResult], text: str) -> GenerationResult:
        """One result for a split text: the parts' codes and rows in order, their timings summed."""
        first, last = parts[0], parts[-1]
        cut = next((p.finish_reason for p in parts if p.finish_reason != "eoc"), last.finish_reason)
        return GenerationResult(
            request_id=first.request_id,
            text=text,
            codes=torch.cat([p.codes for p in parts]),
            rows=torch.cat([p.rows for p in parts]),
            finish_reason=cut,
            seed=first.seed,
            prompt_tokens=sum(p.prompt_tokens for p in parts),
            prefill_ms=sum(p.prefill_ms for p in parts),
            decode_ms=sum(p.decode_ms for p in parts),
            frame_rate=first.frame_rate,
            sample_rate=first.sample_rate,
            cached_tokens=sum(p.cached_tokens for p in parts),
            codec=first.codec,
            parts=parts,
        )

    def _params(self, sampling, count: int, max_frames: int | None) -> list[SamplingParams]:
        if sampling is None:
            sampling = SamplingParams()
        if isinstance(sampling, SamplingParams):
            items = [sampling] * count
        elif isinstance(sampling, Sequence) and not isinstance(sampling, str | bytes):
            items = list(sampling)
        else:
            raise TypeError(
                f"sampling must be a SamplingParams or a list of them, got {type(sampling).__name__}: {sampling!r:.80}"
            )
        if len(items) != count:
            raise ValueError(f"got {len(items)} SamplingParams for {count} texts")
        for s in items:
            if not isinstance(s, SamplingParams):
                raise TypeError(f"sampling must be SamplingParams, got {type(s).__name__}")
        if max_frames is not None:
            items = [replace(s, max_frames=max_frames) for s in items]
        return [s.check_lengths() for s in items]  # min against max once both are final, before any is queued

    def _result(self, req: Request, text: str) -> GenerationResult:
        _raise_if_failed(req)
        rows = torch.stack(req.rows).long() if req.rows else torch.zeros(0, self.cfg.num_codebooks, dtype=torch.long)
        decode_ms = ((req.finished_at or 0) - (req.first_row_at or 0)) * 1e3 if req.rows else 0.0
        return GenerationResult(
            request_id=req.id,
            text=text,
            codes=codec_frames(rows, self.cfg.num_real_codes),
            rows=rows,
            finish_reason=req.finish_reason or "",
            seed=req.seed,
            prompt_tokens=len(req.prompt),
            prefill_ms=req.prefill_ms,
            decode_ms=decode_ms,
            frame_rate=self.cfg.frame_rate,
            sample_rate=None if self.codec_loader is None else self.cfg.sample_rate,
            cached_tokens=req.cached_tokens,
            codec=self.codec_loader,
        )


@dataclass(frozen=True)
class PreparedPart:
    """One request of a prepared text: its words, its sampling (the text's seed, this part's frame cap), its prompt."""

    text: str
    sampling: SamplingParams
    prompt: Prompt


@dataclass(frozen=True)
class PreparedText:
    """A text checked, split and tokenized, ready to queue (``HiggsTalker.prepare``): one part without ``split``."""

    text: str
    parts: tuple[PreparedPart, ...]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all parts."""
        return sum(len(p.prompt) for p in self.parts)


@dataclass
class _Live:
    """A request this caller queued and waits on."""

    rid: str
    req: Request
    ticket: Ticket


def _check_cancel_event(cancel) -> None:
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise TypeError(f"cancel must be a threading.Event (or None), got {type(cancel).__name__}: {cancel!r:.80}")


def _raise_if_cancelled(cancel: threading.Event | None, frames: int) -> None:
    if cancel is not None and cancel.is_set():
        raise GenerationCancelled(f"cancelled after {frames} frames")


def _raise_if_failed(req: Request) -> None:
    if req.error is not None:
        raise GenerationError(f"request {req.id!r} failed after {len(req.rows)} rows: {req.error}") from req.error


def _checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names (``"tiny"``: the embedded one, built on first use)."""
    path = tiny_checkpoint() if str(path) == TINY_NAME else Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} does not exist: give a local checkpoint directory (nothing is downloaded; a "
            "Hugging Face model can be fetched with `hf download ORG/NAME --local-dir DIR`), or 'tiny' for the "
            "embedded default"
        )
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is a file; give the checkpoint directory (config.json, weights)")
    return path


def _checked_checkpoint(path, engine_config: EngineConfig, device: torch.device, dtype: torch.dtype):
    """A checkpoint directory checked as far as it can be before anything is allocated: its config (and
    ``max_model_len`` against it), its tokenizer, the weights' header against the config, and the memory the model
    needs on ``device``. Returns (directory, config, tokenizer, header)."""
    path = _checkpoint_dir(path)
    cfg = checkpoint.read_config(path)
    engine_config.model_len(cfg)
    tokenizer = TalkerTokenizer.from_pretrained(path, cfg)
    header = checkpoint.check_checkpoint(path, cfg)
    check_fits_device(cfg, device, dtype)
    return path, cfg, tokenizer, header


def _engine_config(options: dict) -> EngineConfig:
    try:
        return EngineConfig(**options)
    except TypeError:
        known = ", ".join(EngineConfig.__dataclass_fields__)
        unknown = ", ".join(sorted(k for k in options if k not in EngineConfig.__dataclass_fields__))
        raise TypeError(f"unknown engine option(s) {unknown}; engine options are {known}") from None


def _check_buckets(buckets: Sequence[int] | None, prefill_buckets: Sequence[int] | None) -> None:
    """Refuse bad graph buckets before anything is loaded (CPU, which captures no graphs, included)."""
    if buckets is not None:
        normalize_buckets(buckets, name="buckets")
    if prefill_buckets is not None:
        normalize_buckets(prefill_buckets, allow_empty=True, name="prefill_buckets")


def _resolve_runtime(
    device: str | torch.device, dtype: str | torch.dtype | None, graph_mode: str | None
) -> tuple[torch.device, torch.dtype, GraphMode]:
    """(device, dtype, graph mode) after the defaults: bf16 and auto graphs on CUDA, fp32 and eager on CPU."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported (use 'cpu' or 'cuda')")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if dev.type == "cpu":
        dev = torch.device("cpu")  # 'cpu:0' is the CPU (safetensors refuses the index)
    if dtype is None:
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
        dt = _DTYPES[dtype]
    elif dtype in _DTYPES.values():
        dt = dtype
    else:
        raise ValueError(f"unsupported dtype {dtype}")
    mode = GraphMode.parse(graph_mode or (GraphMode.AUTO if dev.type == "cuda" else GraphMode.EAGER))
    if dev.type != "cuda" and mode is not GraphMode.EAGER:
        raise ValueError(f"graph_mode {mode.value!r} needs a CUDA device; on {dev} use 'eager'")
    return dev, dt, mode


def _empty_model(
    cfg: TalkerConfig, device: torch.device, dtype: torch.dtype, fuse_qk_rope: bool, row_gemv: str = "auto"
) -> TalkerModel:
    """The model with uninitialised weights on ``device`` (built on the meta device and given its dtype there, so
    its weights are allocated once, in ``dtype``, not in float32 and then converted: half the transient memory).
    Each tensor is allocated with ``torch.empty``, as ``to_empty`` does but with ``empty_like``, which on a meta
    tensor runs torch's Python reference ops and imports sympy (seconds where no bytecode is cached)."""
    with torch.device("meta"):
        model = TalkerModel(cfg).to(dtype)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()
    model.use_kernels(default_kernels(device, fuse_qk_rope, row_gemv, cfg.text.head_dim))
    t = cfg.text
    model.rotary_emb.cos_sin = rope_cache(t.head_dim, t.max_position_embeddings, t.rope_theta, device)
    model.multimodal_embedding.offsets = torch.arange(cfg.num_codebooks, device=device) * cfg.codebook_size
    return model
