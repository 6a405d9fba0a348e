"""``SpeechServing``: what the server's routes call. A request is checked completely before anything is queued
(an error is a 4xx naming the field): ``HiggsTalker.prepare`` splits its text into parts at sentence ends (each
capped by ``splitting.frame_budget``) and builds their prompts, once. A worker thread of its own then speaks it
with ``HiggsTalker.stream_audio`` (the engine's driver thread batches every request's steps, a streaming codec
decoder turns the frames into audio) and hands PCM chunks to the event loop; the loop sends them on as they come.

A client that leaves, a timeout, or the server shutting down sets the request's cancel event; ``stream_audio``
sees it at the next frame (one engine step), cancels the request and frees its slot and KV blocks. A failure in
one request (its step, its decoding) ends that request only.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import importlib.util
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from ..api import HiggsTalker, PreparedText
from ..audio import decode_wav, pcm16
from ..codec.streaming import FAST_START_CHUNKING, UPSTREAM_CHUNKING, AudioChunking
from ..heads.sampling import SamplingParams
from ..prompt import PromptTooLong
from ..results import GenerationCancelled, Reference
from ..splitting import DEFAULT_PART_CHARS
from .encoding import ENCODED, FORMATS, AudioEncoder, b64, encode_whole, sse_event, wav_header
from .protocol import (
    APIError,
    ErrorInfo,
    ModelCard,
    ModelList,
    SpeechAudioDelta,
    SpeechAudioDone,
    SpeechError,
    SpeechRequest,
    SpeechUsage,
    VoiceCard,
    VoiceList,
)
from .voices import DEFAULT_VOICE, VoiceStore, check_voice_name

logger = logging.getLogger(__name__)

CHUNKINGS = {"exact": AudioChunking(), "upstream": UPSTREAM_CHUNKING, "fast-start": FAST_START_CHUNKING}
_SAMPLING_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed",
                    "max_frames": "max_new_tokens", "min_frames": "max_new_tokens"}  # fmt: skip
_ids = itertools.count(1)


@dataclass(frozen=True)
class ServeConfig:
    """The server's limits and choices (``higgs-talker serve --help`` lists them as flags)."""

    model_name: str = "higgs-talker"
    max_input_chars: int = 20_000  # longer inputs are refused (400 naming ``input``); they are split to speak them
    max_body_bytes: int = 16 << 20  # request bodies (JSON with ref_audio, voice uploads): 413 beyond
    request_timeout_s: float = 600.0  # a request still running after this is cancelled (408 before its first byte)
    max_new_tokens: int = 2048  # the largest max_new_tokens (audio frames of one part) a request may ask for
    # long input is spoken in parts of at most this many characters, each capped from its text; 0: one prompt of
    # any length, capped only by max_new_tokens (vllm-omni's endpoint)
    part_chars: int = DEFAULT_PART_CHARS
    chunking: str = "exact"  # streamed audio cuts: exact (one-shot audio), upstream or fast-start (CHUNKINGS)
    max_voices: int = 64
    # the sampling of a request that names none: the deploy profiles', with which vllm-omni's speech endpoint
    # samples Stage 0 (its deploy YAMLs); a request's temperature / top_p / top_k override each
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 50

    def __post_init__(self) -> None:
        for name in ("max_input_chars", "max_body_bytes", "max_new_tokens", "part_chars", "max_voices"):
            value, least = getattr(self, name), 0 if name == "part_chars" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s!r}")
        if self.chunking not in CHUNKINGS:
            raise ValueError(f"chunking must be one of {', '.join(CHUNKINGS)}, got {self.chunking!r}")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)  # ValueError naming it
        try:  # the cap of every request's frames: one a request could not be given is refused at start
            SamplingParams(max_frames=self.max_new_tokens)
        except ValueError as exc:
            raise ValueError(str(exc).replace("max_frames", "max_new_tokens", 1)) from None


@dataclass(frozen=True)
class SpeechJob:
    """A checked speech request, ready to run."""

    id: str
    prepared: PreparedText  # the parts, their sampling (one seed) and their prompts, queued as they are
    format: str  # wav | pcm
    mode: str  # file (the whole body at once) | audio (streamed bytes) | sse (streamed events)


class SpeechServing:
    """The talker behind the routes: checks requests, runs them, keeps the uploaded voices."""

    def __init__(self, talker: HiggsTalker, config: ServeConfig | None = None) -> None:
        if talker.codec_loader is None:
            raise ValueError("the server speaks audio: load a checkpoint that bundles its codec (codec=True)")
        self.talker, self.config = talker, config or ServeConfig()
        self.voices = VoiceStore(self.config.max_voices)
        self.sample_rate, self.frame_rate = talker.cfg.sample_rate, talker.cfg.frame_rate
        self.chunking = CHUNKINGS[self.config.chunking]
        talker.prepare_audio(self.chunking)  # the codec and, on CUDA, its stream decodes' graphs: not on a request
        self.created = int(time.time())
        self._active: set[threading.Event] = set()
        self._lock = threading.Lock()
        self.counts = {"finished": 0, "cancelled": 0, "failed": 0}  # requests the workers ended, by how
        self.closing = False

    # ------------------------------------------------------------------ listings

    def models(self) -> ModelList:
        card = ModelCard(
            id=self.config.model_name, created=self.created, max_model_len=self.talker.engine.max_model_len
        )
        return ModelList(data=[card])

    def model(self, name: str) -> ModelCard:
        """The served model's card by its name (OpenAI's ``GET /v1/models/{model}``, ``client.models.retrieve``)."""
        if name != self.config.model_name:
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.config.model_name!r}",
                           "model", code="model_not_found")  # fmt: skip
        return self.models().data[0]

    def voice_list(self) -> VoiceList:
        default = VoiceCard(name=DEFAULT_VOICE, frames=0, seconds=0.0, created_at=self.created)
        return VoiceList(data=[default, *(v.card(self.frame_rate) for v in self.voices.all())])

    @property
    def active_requests(self) -> int:
        with self._lock:
            return len(self._active)

    # ------------------------------------------------------------------ voices

    async def add_voice(self, name: str, audio: bytes, ref_text: str | None) -> VoiceCard:
        """Encode an uploaded WAV recording once and keep its codes under ``name``."""
        check_voice_name(name)
        codes = await asyncio.to_thread(self._encode, audio, "audio")
        # as vllm-omni's upload_voice keeps it: stripped, and a blank one is none (its serving_speech.py:873-875)
        reference = Reference(codes=codes, text=(ref_text or "").strip() or None)
        # the reference text's checks (special tokens, length), and its codes' fit: else every request would fail
        await self._prepare("Hello.", reference, too_long="audio")
        return self.voices.add(name, codes, reference.text).card(self.frame_rate)

    def delete_voice(self, name: str) -> None:
        if name.lower() == DEFAULT_VOICE:
            raise APIError(400, f"{name!r} is the built-in voice (no reference); only uploaded voices can be deleted",
                           "name")  # fmt: skip
        if not self.voices.remove(name):
            raise APIError(404, f"no voice named {name!r}", "name")

    def _encode(self, wav: bytes, param: str):
        """WAV bytes -> reference codes [T, 8] (the codec's encoder; cached by the samples)."""
        try:
            samples, rate = decode_wav(wav, param)
            return self.talker.codec_loader.reference_codes(samples, rate)
        except ValueError as exc:
            raise APIError(400, str(exc), param) from None

    # ------------------------------------------------------------------ speech

    async def prepare(self, req: SpeechRequest) -> SpeechJob:
        """Check every field of a speech request and build its prompts (not queued yet); ``APIError`` names the
        field at fault."""
        cfg = self.config
        if req.model is not None and req.model != cfg.model_name:
            raise APIError(
                404,
                f"model {req.model!r} is not served here; this server serves {cfg.model_name!r}",
                "model",
                code="model_not_found",  # OpenAI's code for it
            )
        if len(req.input) > cfg.max_input_chars:
            raise APIError(
                400,
                f"input holds {len(req.input)} characters; this server takes at most {cfg.max_input_chars}",
                "input",
            )
        if not req.input.strip():
            raise APIError(400, "input is empty or whitespace only", "input")
        if req.speed != 1.0:
            raise APIError(400, f"speed {req.speed!r} is not supported: this model speaks at 1.0 only", "speed")
        if req.instructions:
            raise APIError(400, "instructions are not supported by this model; choose a voice instead", "instructions")
        if req.response_format not in FORMATS:
            raise APIError(
                400,
                f"response_format {req.response_format!r} is not supported: this server writes "
                f"{', '.join(FORMATS)} (mono at {self.sample_rate} Hz; pcm: 16-bit little-endian samples)",
                "response_format",
            )
        if req.response_format in ENCODED and importlib.util.find_spec("av") is None:
            raise APIError(
                400,
                f"response_format {req.response_format!r} needs PyAV on the server (pip install -e '.[serve]' in "
                "the higgs_talker checkout); wav and pcm need nothing more",
                "response_format",
            )
        if req.stream_format == "sse" and req.stream is False:
            raise APIError(
                400, "stream_format 'sse' streams events; it cannot be combined with stream: false", "stream"
            )
        reference = await self._reference(req)
        params = self._sampling(req)
        too_long = "input" if reference is None else "ref_audio" if req.ref_audio else "voice"
        prepared = await self._prepare(req.input, reference, params, too_long)
        # vllm-omni's rule where no stream_format is given: ``stream: true`` selects events, ``false`` the file
        sse = req.stream_format == "sse" or (req.stream is True and req.stream_format is None)
        mode = "sse" if sse else "file" if req.stream is False else "audio"
        return SpeechJob(id=f"speech-{next(_ids)}", prepared=prepared, format=req.response_format, mode=mode)

    async def _prepare(
        self, text: str, reference: Reference | None, params: SamplingParams | None = None, too_long: str = "input"
    ) -> PreparedText:
        """``text`` split into parts of at most ``part_chars`` and their prompts built and checked, once (in a
        thread: a long input takes a while to tokenize); the worker queues these prompts as they are. A prompt
        that leaves no room for audio is a 400 naming ``too_long``, the field that made it long."""
        split = self.config.part_chars or False  # 0: one prompt, as given
        try:
            return await asyncio.to_thread(self.talker.prepare, text, params, reference, split=split)
        except PromptTooLong as exc:
            codes = " (the reference's codes count in it)" if too_long != "input" else ""
            raise APIError(400, f"{exc}{codes}", too_long) from None
        except ValueError as exc:
            param = "ref_text" if "reference_text" in str(exc) else "input"
            message = str(exc)
            if param == "input" and message.startswith("text "):  # the API's name for what this request calls input
                message = "input " + message.removeprefix("text ")
            raise APIError(400, message, param) from None

    async def _reference(self, req: SpeechRequest) -> Reference | None:
        name = req.voice.id if req.voice is not None and not isinstance(req.voice, str) else req.voice
        named = name not in (None, "") and name.lower() != DEFAULT_VOICE  # names match in any case
        if req.ref_audio is not None:
            if named:
                raise APIError(400, f"give either voice {name!r} or ref_audio, not both", "voice")
            wav = _data_url_bytes(req.ref_audio)
            codes = await asyncio.to_thread(self._encode, wav, "ref_audio")
            return Reference(codes=codes, text=req.ref_text or None)
        if req.ref_text:
            what = f"voice {name!r} carries its own reference text" if named else "ref_text needs ref_audio"
            raise APIError(400, f"ref_text describes ref_audio: {what}", "ref_text")
        if not named:
            return None
        voice = self.voices.get(name)
        if voice is None:
            known = ", ".join(v.name for v in self.voice_list().data)
            raise APIError(
                400,
                f"voice {name!r} is not known here; voices: {known} (upload one with POST /v1/audio/voices)",
                "voice",
            )
        return voice.reference

    def _sampling(self, req: SpeechRequest) -> SamplingParams:
        cfg = self.config
        given = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
        if req.max_new_tokens is not None and req.max_new_tokens > cfg.max_new_tokens:
            raise APIError(
                400,
                f"max_new_tokens {req.max_new_tokens} is above this server's limit of {cfg.max_new_tokens} frames",
                "max_new_tokens",
            )
        extra = req.extra_params or {}
        for key in extra:
            if key not in _EXTRA_SAMPLING:
                raise APIError(400, f"extra_params.{key} is not understood here; it takes {', '.join(_EXTRA_SAMPLING)}",
                               f"extra_params.{key}")  # fmt: skip
        for name in ("temperature", "top_k", "top_p", "seed"):
            value, other = getattr(req, name), extra.get(name)
            if value is not None and other is not None and value != other:
                raise APIError(400, f"{name} {value!r} and extra_params.{name} {other!r} differ; give it once", name)
            if value is not None or other is not None:
                given[name] = value if value is not None else other
        try:
            return SamplingParams(**given, max_frames=req.max_new_tokens or cfg.max_new_tokens)
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            from_extra = name in extra and getattr(req, name) is None  # given in extra_params alone
            field = f"extra_params.{name}" if from_extra else _SAMPLING_FIELDS.get(name)
            message = str(exc) if field is None or field == name else f"{field}: {exc}"
            raise APIError(400, message, field) from None

    # ------------------------------------------------------------------ running

    async def run(self, job: SpeechJob, watch: Callable[[], Awaitable[object]]) -> bytes | AsyncIterator[bytes]:
        """The response body of ``job``: all bytes (mode file), or an iterator of them (audio, sse) whose first item
        is already made, so that a failure before the first byte is still an ``APIError`` (and a status code).

        ``watch()`` returns when the client has gone; until the body is handed over, the request is cancelled then.
        """
        items = self._items(job)
        try:
            if job.mode == "file":
                return await _until_gone(self._whole(job, items), watch)
            first = await _until_gone(anext(items), watch)
            if first[0] in ("error", "cancelled"):  # before the first byte: still a status code and a JSON error
                raise _failure(job, *first)
        except BaseException:
            await items.aclose()
            raise
        return self._stream(job, first, items)

    async def _whole(self, job: SpeechJob, items: AsyncIterator[tuple]) -> bytes:
        pcm = []
        async for kind, value in items:
            if kind == "audio":
                pcm.append(value)
            elif kind != "done":
                raise _failure(job, kind, value)
        data = b"".join(pcm)
        if job.format in ENCODED:
            return await asyncio.to_thread(encode_whole, job.format, self.sample_rate, data)
        return wav_header(self.sample_rate, len(data)) + data if job.format == "wav" else data

    async def _stream(self, job: SpeechJob, first: tuple, items: AsyncIterator[tuple]) -> AsyncIterator[bytes]:
        pending = wav_header(self.sample_rate) if job.format == "wav" else b""  # owed before the next audio
        # FFmpeg's encoders run in a thread (an MP3 second takes ~12 ms of CPU): the loop serves the other clients
        encoder = await asyncio.to_thread(AudioEncoder, job.format, self.sample_rate) if job.format in ENCODED else None
        item: tuple | None = first
        try:
            while item is not None:
                kind, value = item
                if kind == "audio":
                    data = value if encoder is None else await asyncio.to_thread(encoder.encode, value)
                    data, pending = pending + data, b""
                    if data:  # an encoder may hold a chunk back whole
                        yield sse_event(SpeechAudioDelta(audio=b64(data))) if job.mode == "sse" else data
                elif kind == "done":
                    if encoder is not None:  # the encoder's last frames and the container's end
                        pending = await asyncio.to_thread(encoder.finish)
                    if job.mode == "sse":
                        if pending:
                            yield sse_event(SpeechAudioDelta(audio=b64(pending)))
                        tokens = job.prepared.prompt_tokens
                        usage = SpeechUsage(input_tokens=tokens, output_tokens=value, total_tokens=tokens + value)
                        yield sse_event(SpeechAudioDone(usage=usage))
                    elif pending:  # the encoder's end, or a WAV header with no audio at all (a valid empty stream)
                        yield pending
                else:  # failed after its first byte: no status code left to send
                    err = _failure(job, kind, value)
                    if job.mode != "sse":
                        raise StreamCut(f"{job.id} cut mid-stream: {err.message}")  # the app closes the connection
                    yield sse_event(SpeechError(error=ErrorInfo(**err.body().error.model_dump())))
                item = await anext(items, None)
        finally:
            await items.aclose()

    async def _items(self, job: SpeechJob) -> AsyncIterator[tuple]:
        """("audio", pcm bytes)..., then one of ("done", frames), ("error", exc), ("cancelled", why): made by a
        worker thread of this request, cancelled when this iterator is closed or the deadline passes."""
        if self.closing:
            raise APIError(503, "the server is shutting down", None)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def post(item: tuple) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                cancel.set()

        with self._lock:
            self._active.add(cancel)
        worker = threading.Thread(target=self._speak, args=(job, post, cancel), name=job.id, daemon=True)
        worker.start()
        deadline = loop.time() + self.config.request_timeout_s
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), max(deadline - loop.time(), 0.0))
                except asyncio.TimeoutError:
                    item = ("cancelled", "timeout")
                yield item
                if item[0] != "audio":
                    return
        finally:
            cancel.set()
            with self._lock:
                self._active.discard(cancel)

    def _speak(self, job: SpeechJob, post: Callable[[tuple], None], cancel: threading.Event) -> None:
        """The worker: ``stream_audio`` of the job's prepared text, as PCM chunks, until it ends or is cancelled."""
        t0, samples = time.perf_counter(), 0
        chunks = self.talker.stream_audio(job.prepared, chunking=self.chunking, cancel=cancel)
        try:
            for chunk in chunks:
                samples += chunk.shape[0]
                post(("audio", pcm16(chunk)))
        except GenerationCancelled as exc:  # the request's slot and KV blocks are free already
            self._count("cancelled")
            post(("cancelled", "shutdown" if self.closing else "cancelled"))
            logger.info("%s %s", job.id, exc)
            return
        except Exception as exc:  # noqa: BLE001 - this request fails; the server and the other requests go on
            logger.warning("%s failed after %.2f s of audio: %r", job.id, samples / self.sample_rate, exc)
            self._count("failed")
            post(("error", exc))
            return
        finally:
            chunks.close()  # a loop left early cancels the engine request (and any queued part) at once
        frames = samples // self.talker.codec.hop_length  # every frame decodes to one hop of samples
        self._count("finished")
        post(("done", frames))
        logger.info(
            "%s: %d parts, %d frames (%.2f s of audio) in %.2f s",
            job.id,
            len(job.prepared.parts),
            frames,
            frames / self.frame_rate,
            time.perf_counter() - t0,
        )

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def shutdown(self) -> None:
        """Refuse new requests and cancel every running one (their streams end at the next engine step)."""
        self.closing = True
        with self._lock:
            for cancel in self._active:
                cancel.set()


_EXTRA_SAMPLING = ("temperature", "top_p", "top_k")  # what vllm-omni's endpoint reads from extra_params


def _failure(job: SpeechJob, kind: str, value) -> APIError:
    if kind == "cancelled" and value == "timeout":
        return APIError(408, f"{job.id} ran past the server's request timeout and was cancelled", "timeout")
    if kind == "cancelled":
        return APIError(503, f"{job.id} was cancelled: the server is shutting down", None)
    return APIError(500, f"{job.id} failed: {type(value).__name__}: {value}", None)


async def _until_gone(aw: Awaitable, watch: Callable[[], Awaitable[object]]):
    """``await aw``, unless the client leaves first (then ``aw`` is cancelled and ``ClientGone`` raised)."""
    work = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ClientGone()
        return work.result()
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})  # let it unwind (its iterator closes) before anyone touches that again


class StreamCut(Exception):
    """A streamed body that has to end cut off (its status code is sent already): ``app.CutStreams`` logs one line
    and closes the connection without the body's last chunk, so the client sees it incomplete, not a traceback."""


class ClientGone(Exception):
    """The client closed its connection before the response started."""


_URL_SAFE = str.maketrans("-_", "+/")


def _data_url_bytes(url: str) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URL (base64 only)."""
    if not url.startswith("data:") or "," not in url:
        raise APIError(400, "ref_audio must be a data: URL such as data:audio/wav;base64,UklGR...", "ref_audio")
    head, data = url[5:].split(",", 1)
    if not head.endswith(";base64"):
        raise APIError(400, "ref_audio must be base64 encoded (data:audio/wav;base64,...)", "ref_audio")
    try:  # line breaks (base64 without -w0, encodebytes) and the URL-safe alphabet are base64 all the same
        return base64.b64decode("".join(data.split()).translate(_URL_SAFE), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "ref_audio holds invalid base64", "ref_audio") from None
