"""Chunked decoding: waveform chunks as frames arrive, concatenating to the one-shot decode.

The rule is upstream's (SPEC_codec 4.2): with ``emitted`` frames sent and ``available`` received, a chunk is
due once ``available - holdback - emitted`` reaches the chunk size (the first chunk's own size for the first
one), or when the stream has finished. The chunk decodes the window
``[emitted - min(left, emitted), available)`` and keeps only the new frames' samples
``[emitted, available - holdback)`` (holdback 0 at the end). Nothing is cross-faded: chunks are concatenated.

Exactness: the DAC decoder is not causal; a frame's samples depend on the codes of ``Codec.context_frames``
= (10, 10) frames around it (``model.decoder_reach``). When the left context and the holdback both cover
that reach, every kept sample sees all of its inputs, and the concatenated chunks equal a one-shot decode up
to float rounding (the same arithmetic on a shorter window). That is the default. Upstream's deploy
profiles hold back 4 frames, so the last ~6 frames of each of their chunks are decoded without all of
their future context and differ from the one-shot audio (by up to 39-47 % of peak with random weights,
SPEC_codec 4.4); ``UPSTREAM_CHUNKING`` reproduces that schedule. Each frame held back is one more talker step
before the first chunk: the default waits for 11 frames, upstream's for 5. ``first_holdback_frames`` sets the
first chunk's holdback alone: ``FAST_START_CHUNKING`` sends its first 3 frames at once (not exact), every later
chunk exact.

Many streams of one codec share its decodes (``WindowBatcher``): windows queued while a decode runs are decoded
together in the next one, so a chunk's samples can differ by float rounding from the same window decoded alone.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..heads.delay import aligned_frames


@dataclass(frozen=True)
class AudioChunking:
    """How streamed audio is cut; ``None`` context sizes mean the codec's reach (exact streaming)."""

    chunk_frames: int = 25  # new frames per chunk in steady state
    first_chunk_frames: int = 1  # frames of the first chunk (a low time to first audio), at most chunk_frames
    left_context_frames: int | None = None  # already-emitted frames decoded again in front of the new ones
    holdback_frames: int | None = None  # newest frames decoded as future context but not emitted yet
    first_holdback_frames: int | None = None  # the first chunk's holdback (None: holdback_frames), for earlier audio
    # chunks after the first as long as the audio already sent (at least first_chunk_frames, at most chunk_frames):
    # the audio sent doubles chunk by chunk, so a player that starts with the first chunk never waits for the next
    # while the talker runs faster than twice real time; off (upstream's cuts), a one-frame first chunk plays out
    # long before the talker has made the next 25 frames and their holdback
    ramp: bool = True

    def __post_init__(self) -> None:
        for name in ("chunk_frames", "first_chunk_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AudioChunking.{name} must be an integer >= 1, got {value!r}")
        if self.first_chunk_frames > self.chunk_frames:
            raise ValueError(
                f"AudioChunking.first_chunk_frames ({self.first_chunk_frames}) exceeds chunk_frames "
                f"({self.chunk_frames})"
            )
        if not isinstance(self.ramp, bool):
            raise ValueError(f"AudioChunking.ramp must be True or False, got {self.ramp!r}")
        for name in ("left_context_frames", "holdback_frames", "first_holdback_frames"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"AudioChunking.{name} must be None or an integer >= 0, got {value!r}")

    @property
    def first_chunk_holdback(self) -> int | None:
        """The first chunk's holdback: ``first_holdback_frames``, else ``holdback_frames``."""
        return self.holdback_frames if self.first_holdback_frames is None else self.first_holdback_frames

    def resolved(self, reach: tuple[int, int]) -> AudioChunking:
        """The same rule with ``None`` context sizes replaced by the codec's reach (before, after)."""
        left = reach[0] if self.left_context_frames is None else self.left_context_frames
        hold = reach[1] if self.holdback_frames is None else self.holdback_frames
        first_hold = hold if self.first_holdback_frames is None else self.first_holdback_frames
        return AudioChunking(self.chunk_frames, self.first_chunk_frames, left, hold, first_hold, self.ramp)


# vllm-omni's deploy profiles (codec_chunk_frames 25, codec_left_context_frames 25, codec_right_holdback_frames 4,
# initial_codec_chunk_frames 1): the same chunk boundaries as upstream, and the same deviations from one-shot audio
UPSTREAM_CHUNKING = AudioChunking(
    chunk_frames=25, first_chunk_frames=1, left_context_frames=25, holdback_frames=4, ramp=False
)
# The first 3 frames (120 ms of audio) decoded as soon as they exist, without their future context (so they differ
# from one-shot audio, the more the nearer their end), every later chunk exact (and ramped). The first 3 frames last
# while the talker makes the 13 frames the next chunk needs (3 and the holdback) at up to 9.2 ms a step.
FAST_START_CHUNKING = AudioChunking(first_chunk_frames=3, first_holdback_frames=0)


@dataclass(frozen=True)
class Window:
    """One decode: frames ``[start, end)`` are decoded, the samples of ``[emit_start, emit_end)`` kept."""

    start: int
    end: int
    emit_start: int
    emit_end: int


def chunk_due(emitted: int, rule: AudioChunking) -> int:
    """How many new frames the next chunk holds once ``emitted`` frames were sent (pure)."""
    if emitted == 0:
        return rule.first_chunk_frames
    return min(max(emitted, rule.first_chunk_frames), rule.chunk_frames) if rule.ramp else rule.chunk_frames


# Upstream's deploy YAMLs set its hand-over's chunks in a connector's extras (these keys, these defaults); our
# hand-over reads one more, RAMP_KEY: chunks ramped (AudioChunking.ramp)
CONNECTOR_KEYS = (("codec_chunk_frames", 25), ("initial_codec_chunk_frames", 0), ("codec_left_context_frames", 25),
                  ("codec_right_holdback_frames", 4))  # fmt: skip
RAMP_KEY = "codec_chunk_ramp"


def connector_rule(extra) -> AudioChunking:
    """The rule a connector's extras set (``CONNECTOR_KEYS``, ``RAMP_KEY``): a first chunk of 0 frames, or of
    ``chunk_frames`` and more, means ``chunk_frames``, as upstream's hand-over reads it. ValueError naming the extras
    where they make no rule."""
    try:
        values = [int(extra.get(key, default) or 0) for key, default in CONNECTOR_KEYS]
        return _connector_rule(*values, bool(extra.get(RAMP_KEY)))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad codec chunk settings in a connector's extras {dict(extra)}: {exc}") from None


@functools.lru_cache(maxsize=32)
def _connector_rule(chunk_frames: int, first_chunk_frames: int, left: int, holdback: int, ramp: bool) -> AudioChunking:
    """``connector_rule``'s rule, built once per setting: upstream asks its hand-over per request per step."""
    first = first_chunk_frames if 0 < first_chunk_frames < chunk_frames else chunk_frames
    return AudioChunking(chunk_frames, first, left, holdback, None, ramp)


def next_window(available: int, emitted: int, finished: bool, rule: AudioChunking) -> Window | None:
    """The chunk due now under a resolved ``rule``, or None (pure: the whole schedule in one function)."""
    assert rule.left_context_frames is not None and rule.holdback_frames is not None, "resolve the rule first"
    if finished:
        emit_end = available
    else:
        emit_end = available - (rule.first_chunk_holdback if emitted == 0 else rule.holdback_frames)
        due = chunk_due(emitted, rule)
        if emit_end - emitted < due:
            return None
    if emit_end <= emitted:
        return None
    return Window(max(0, emitted - rule.left_context_frames), available, emitted, emit_end)


def delayed_rows_chunk(rows: list, emitted: int, finished: bool, rule: AudioChunking, num_real_codes: int = 1024):
    """The chunk due now of a stream handed on as delayed rows (``rows``: lists of C codes, one a step), ``emitted``
    frames sent, under a resolved ``rule``: ``(window, frames)``, its window over the aligned frames and what the
    codec reads of them [F, C] int64 (BOC, EOC, anything outside ``[0, num_real_codes)``: 0; a finished stream's
    last frame, the delay pattern's ramp-down, dropped as ``heads.delay.codec_frames`` does), or None."""
    width = len(rows[0]) if rows else 1
    window = next_window(max(0, len(rows) - width + 1), emitted, finished, rule)
    if window is None:
        return None
    frames = aligned_frames(rows, window.start, window.end, num_real_codes)
    return window, frames[:-1] if finished and frames.shape[0] >= 2 else frames


def window_lengths(rule: AudioChunking) -> list[int]:
    """The lengths (frames) of the windows a resolved ``rule`` decodes while a stream runs, in order of first use:
    the first few, then the steady one (pure). The last window of a stream, cut by its end, may have any other."""
    open_sizes = [n for n in ("left_context_frames", "holdback_frames") if getattr(rule, n) is None]
    if open_sizes:  # (the first holdback is the holdback where it is not given)
        raise ValueError(f"window_lengths needs a resolved rule: {', '.join(open_sizes)} of {rule} are None (the "
                         "codec's reach); pass rule.resolved(codec.context_frames)")  # fmt: skip
    lengths: list[int] = []
    emitted, steady = 0, rule.left_context_frames + rule.chunk_frames + rule.holdback_frames
    # the first window (and one that catches up after it where the first holdback is the longer), the ramp's (its
    # chunks reach chunk_frames within two chunks' frames), then one a chunk: within one more steady window's frames
    # one starts past the left context, and every later one is steady
    for available in range(1, rule.first_chunk_frames + rule.first_chunk_holdback + 3 * steady + 1):
        window = next_window(available, emitted, False, rule)
        if window is not None:
            lengths.append(window.end - window.start)
            emitted = window.emit_end
    return list(dict.fromkeys([*lengths, steady]))


class StreamingDecoder:
    """Push aligned frames [Q] (or [k, Q]) as they arrive; each push returns a waveform chunk or None.

    ``finish()`` returns the rest. The chunks are float32 on the host (``Codec.decode_windows_to_host``).
    """

    def __init__(self, codec, chunking: AudioChunking | None = None) -> None:
        if chunking is not None and not isinstance(chunking, AudioChunking):
            raise TypeError(
                f"chunking must be an AudioChunking or None, got {type(chunking).__name__}: {chunking!r:.60}"
            )
        self.codec = codec
        self.rule = (chunking or AudioChunking()).resolved(codec.context_frames)
        before, after = codec.context_frames
        hold = min(self.rule.holdback_frames, self.rule.first_chunk_holdback)
        self.exact = self.rule.left_context_frames >= before and hold >= after
        self._codes = torch.zeros(0, codec.num_quantizers, dtype=torch.long)
        self._offset = 0  # frame index of self._codes[0]
        self.available = self.emitted = 0
        self.finished = False

    def push(self, frames: Tensor) -> Tensor | None:
        """Add frames [Q] or [k, Q] (checked like ``Codec.decode``'s codes); the chunk now due, if any."""
        if self.finished:
            raise ValueError("this stream has finished; start a new StreamingDecoder")
        frames = frames[None] if isinstance(frames, Tensor) and frames.dim() == 1 else frames
        frames = self.codec.check_codes(frames).cpu()
        self._codes = torch.cat([self._codes, frames])
        self.available += frames.shape[0]
        return self._emit(next_window(self.available, self.emitted, False, self.rule))

    def frames_wanted(self) -> int:
        """How many more frames make the next chunk due (>= 1): a push of that many returns it, a shorter one None."""
        hold = self.rule.first_chunk_holdback if self.emitted == 0 else self.rule.holdback_frames
        return max(1, self.emitted + hold + chunk_due(self.emitted, self.rule) - self.available)

    def finish(self) -> Tensor | None:
        """The remaining samples (holdback 0), or None when everything was emitted."""
        if self.finished:
            return None
        self.finished = True
        return self._emit(next_window(self.available, self.emitted, True, self.rule))

    def _emit(self, window: Window | None) -> Tensor | None:
        if window is None:
            return None
        codes = self._codes[window.start - self._offset : window.end - self._offset]
        chunk = self.codec.windows.decode(codes, window.emit_start - window.start, window.end - window.emit_end)
        self.emitted = window.emit_end
        keep = max(0, self.emitted - self.rule.left_context_frames)  # the next window starts at or after this
        self._codes = self._codes[keep - self._offset :]
        self._offset = keep
        return chunk


@dataclass(eq=False)
class _Pending:
    window: tuple[Tensor, int, int]  # codes [T, Q], trim_front, trim_back
    result: Tensor | None = None
    error: BaseException | None = None
    done: bool = False
    woken: threading.Event = field(default_factory=threading.Event)  # done, or this stream is to run the queue
    leads: bool = False  # chosen (under the batcher's lock) to run the queue next; set before ``woken``


class WindowBatcher:
    """One codec's streamed decodes, from any number of threads, batched while one runs (group commit).

    A stream that has a window to decode queues it; if no decode is running it takes every queued window and
    decodes them together (``Codec.decode_windows``: one batch per window length), else it waits, and when the
    running decode ends the stream of the oldest window still queued is woken to take the queue in turn, and the
    decoded ones are woken each (no other thread: 64 streams woken at every decode to find nothing for them had
    cost the host as much as the decodes). One stream alone decodes at once, as without the batcher; many streams
    share each decode instead of queueing one decode each on the device and the interpreter (streamed audio under
    load was bound by one decode per chunk). A batch whose decode raises is decoded again window by window, so only
    a window that fails alone raises, in its own stream; the next decode starts afresh.
    """

    def __init__(self, codec) -> None:
        self.codec = codec
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._running = False

    def decode(self, codes: Tensor, trim_front: int, trim_back: int) -> Tensor:
        """``Codec.decode_windows_to_host([(codes, trim_front, trim_back)])[0]``, decoded with whatever else is
        queued."""
        mine = _Pending((codes, trim_front, trim_back))
        with self._lock:
            self._queue.append(mine)
            lead, self._running = not self._running, True
            if lead:
                batch, self._queue = self._queue, []
        if not lead:
            try:
                mine.woken.wait()
            except BaseException:  # Ctrl-C in the main thread: the queue must not wait on this stream to run it
                self._leave(mine)
                raise
            if not mine.done:  # woken to run the queue (its window among it)
                with self._lock:
                    batch, self._queue = self._queue, []
                lead = True
        if lead:
            self._run(batch)
        if mine.error is not None:
            raise mine.error
        return mine.result

    def _leave(self, mine: _Pending) -> None:
        """A stream gone while it waited: its window leaves the queue, and where it was woken to run the queue, the
        next queued window's stream runs it instead."""
        with self._lock:
            if mine in self._queue:
                self._queue.remove(mine)
            if not mine.leads:  # read under the lock: a decode's end may have chosen it and not woken it yet
                return
            following = self._next_runner()
        if following is not None:
            following.woken.set()

    def _next_runner(self) -> _Pending | None:
        """Under the lock, as a decode ends or its next runner left: the oldest queued window, whose stream runs the
        queue next (``_running`` stays set), or None, with nothing running."""
        following = self._queue[0] if self._queue else None
        self._running = following is not None
        if following is not None:
            following.leads = True
        return following

    def _alone(self, p: _Pending) -> Tensor | None:
        try:
            return self.codec.decode_windows_to_host([p.window])[0]
        except Exception as exc:  # noqa: BLE001 - this window's stream raises it
            p.error = exc
            return None

    def _run(self, batch: list[_Pending]) -> None:
        try:
            try:
                results = self.codec.decode_windows_to_host([p.window for p in batch])
            except Exception:  # noqa: BLE001 - decoded again one by one: only a window that fails alone fails
                if len(batch) == 1:
                    raise
                results = [self._alone(p) for p in batch]
            for p, result in zip(batch, results, strict=True):
                p.result = result
        except BaseException as exc:  # noqa: BLE001 - Ctrl-C or the lone window's error, raised in its stream(s)
            for p in batch:
                if p.result is None and p.error is None:
                    p.error = exc
        finally:
            with self._lock:
                for p in batch:
                    p.done = True
                following = self._next_runner()
            for p in batch if following is None else [*batch, following]:
                p.woken.set()
