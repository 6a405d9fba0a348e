"""CUDA graphs of the codec's streamed decodes: one per (batch bucket, window length).

A streamed request decodes windows of a few lengths only (``codec.streaming.window_lengths``: the first ones, then
the steady one). Each decode is a few hundred small kernels that the host launches one at a time (the decoder's
convolutions and Snake activations: 423 aten calls at any length), so on the H200 a window of 11 frames took as
long as a one-shot decode of 250 (7.8 vs 7.6 ms, ``codec_20261201-122637.json``) and held the interpreter, and
with it the engine's thread, all that time. A graph replays them in one launch.

Each graph is captured, then replayed on other random codes and compared with an eager decode of those (kept only
if equal: a graph that recorded nothing would return stale audio), then both are timed (CUDA events) and the graph
is kept only where it was faster; anything else decodes eagerly, with one warning for a failure. A batch between
buckets fills the bucket's first rows; the rest keep the codes they held before (the decoder treats each batch row
alone, so they change nothing in the others). A batch above the largest bucket replays that bucket's graph piece
by piece. Captures and replays run on the codec's device, in CUDA's thread-local capture mode; ``HiggsTalker``
captures only while nothing else uses the talker (``HiggsTalker.prepare_audio``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from .capture import capture_graph, graph_pool, median_ms

logger = logging.getLogger(__name__)

BATCHES = (1, 2, 4, 8)  # batch buckets: windows that a codec's streams queued together (``WindowBatcher``)
_ATTACH = threading.Lock()


def capture_stream_graphs(codec, lengths: Iterable[int], batches: Iterable[int] = BATCHES) -> dict | None:
    """On CUDA, graphs of ``codec.decode_windows``' decodes of windows of ``lengths`` frames in batches of
    ``batches`` (``CodecGraphs``, attached to the codec as ``codec.graphs``); shapes tried before are not tried
    again. Returns the report of the shapes tried now, (batch, frames) -> what decodes it; None on the CPU."""
    if codec.device.type != "cuda":
        return None
    with _ATTACH:
        if codec.graphs is None:
            codec.graphs = CodecGraphs(codec.model.decode, codec.num_quantizers, codec.codebook_size, codec.device)
    return codec.graphs.capture(lengths, batches)


def missing_stream_graphs(codec, lengths: Iterable[int], batches: Iterable[int] = BATCHES) -> bool:
    """Whether ``capture_stream_graphs`` would try a shape for these lengths (none tried yet)."""
    return codec.graphs is None or bool(codec.graphs.untried(lengths, batches))


class CodecGraphs:
    """``decode(codes [B, Q, T])`` through a captured graph where one was kept for (bucket of B, T), else None."""

    def __init__(
        self,
        decode: Callable[[Tensor], Tensor],
        num_quantizers: int,
        codebook_size: int,
        device: torch.device,
        *,
        capture=capture_graph,
        timer: Callable[[Callable[[], object]], float] = median_ms,
    ) -> None:
        self._decode, self.device = decode, device  # decode: codes [B, Q, T] int64 on device -> [B, 1, T * hop]
        self.num_quantizers, self.codebook_size = num_quantizers, codebook_size
        self._capture, self._timer = capture, timer
        self._graphs: dict[tuple[int, int], tuple[object, Tensor, Tensor]] = {}  # (bucket, T) -> graph, in, out
        self._buckets: dict[int, list[int]] = {}  # T -> its buckets, ascending; replaced whole (read without lock)
        self.report: dict[tuple[int, int], str] = {}  # every (bucket, T) tried: what decodes it, and why
        self._pool = None
        self._lock = threading.Lock()  # one replay at a time: the graphs share their static inputs and pool

    def capture(self, lengths: Iterable[int], batches: Iterable[int] = BATCHES) -> dict[tuple[int, int], str]:
        """Capture, check and time a graph for each (batch, length) not tried before, largest first (the smaller
        ones then reuse the pool's memory). Returns the report of the ones tried now."""
        lengths, batches = list(lengths), list(batches)
        if not self.untried(lengths, batches):  # every later stream asks again: no lock then
            return {}
        with self._lock, torch.no_grad():  # not inference mode: the static inputs are written in and out of it
            if self.device.type == "cuda":  # replays queued on other streams (a codec's own) share the pool: done
                torch.cuda.synchronize(self.device)
            new = sorted(self.untried(lengths, batches), key=lambda k: (k[0] * k[1], k), reverse=True)  # biggest first
            for key in new:
                try:
                    self.report[key] = self._capture_one(*key)
                except Exception as exc:  # noqa: BLE001 - any failure means: this shape decodes eagerly
                    self.report[key] = f"eager (capture failed: {type(exc).__name__}: {exc})"
                    logger.warning("codec graph for %d window(s) of %d frames: capture failed (%s: %s); that shape "
                                   "decodes eagerly", *key, type(exc).__name__, exc)  # fmt: skip
        report = {key: self.report[key] for key in new}
        if new:  # (another thread may have captured them meanwhile)
            kept = sum(v.startswith("graph") for v in report.values())
            logger.info("codec graphs for windows of %s frames: %d of %d shapes replay a graph (batches %s)",
                        sorted({t for _, t in new}), kept, len(new), sorted({b for b, _ in new}))  # fmt: skip
        return report

    def untried(self, lengths: Iterable[int], batches: Iterable[int]) -> set[tuple[int, int]]:
        """The (batch, length) shapes no capture has tried yet."""
        return {(b, t) for t in lengths for b in batches} - self.report.keys()

    def _on_device(self):
        """The codec's device as the current one (a codec on another GPU than the current one would run eagerly
        there while its graph recorded nothing)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _capture_one(self, batch: int, frames: int) -> str:
        g = torch.Generator(device=self.device).manual_seed(batch * 100_003 + frames)
        shape = (batch, self.num_quantizers, frames)
        static, codes = (torch.randint(0, self.codebook_size, shape, generator=g, device=self.device) for _ in "ab")
        if self._pool is None:
            self._pool = graph_pool() if self.device.type == "cuda" else None
        pool = None if self._pool is None else self._pool.id
        with self._on_device():
            graph, out = self._capture(lambda: self._decode(static), pool=pool, mode="thread_local")
            static.copy_(codes)  # other codes than the capture saw: a replay that recorded nothing fails the check
            graph.replay()
            want = self._decode(codes)
            if not torch.equal(out, want):
                diff = (out.float() - want.float()).abs().max().item()
                raise RuntimeError(f"its replay differs from an eager decode of the same codes (max |diff| {diff:.3g})")
            eager_ms, graph_ms = self._timer(lambda: self._decode(codes)), self._timer(graph.replay)
        if graph_ms >= eager_ms:
            return f"eager (faster: {eager_ms:.3f} ms, graph {graph_ms:.3f} ms)"
        self._graphs[(batch, frames)] = (graph, static, out)
        self._buckets = {**self._buckets, frames: sorted([*self._buckets.get(frames, []), batch])}
        return f"graph ({graph_ms:.3f} ms, eager {eager_ms:.3f} ms)"

    def decode(self, codes: Tensor) -> Tensor | None:
        """codes [B, Q, T] int64 on the device -> the decoder's output [B, 1, T * hop] (a copy, not the graph's
        memory), or None where no graph was kept for T."""
        buckets = self._buckets.get(codes.shape[-1])
        if not buckets or codes.shape[0] == 0:
            return None
        pieces = codes.split(buckets[-1])  # above the largest bucket: its graph replayed per piece
        with self._lock, self._on_device():
            outs = [self._replay(piece, next(b for b in buckets if b >= piece.shape[0])) for piece in pieces]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _replay(self, codes: Tensor, bucket: int) -> Tensor:
        graph, static, out = self._graphs[(bucket, codes.shape[-1])]
        n = codes.shape[0]
        static[:n].copy_(codes)  # rows past n keep earlier codes (valid ones): decoded alone and dropped
        graph.replay()
        return out[:n].clone()

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (batch bucket, frames) shapes that replay a graph."""
        return sorted(self._graphs)
