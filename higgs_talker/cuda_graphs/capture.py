"""The one capture recipe, the one capture-and-verify loop over buckets, and the one CUDA timer."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from .policy import local_graphs_allowed_now

T = TypeVar("T")
logger = logging.getLogger(__name__)


def capture_graph(fn: Callable[[], T], pool=None, mode: str = "global") -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``fn`` once on a side stream (lazy initialisation and autotuning stay out of the graph), then capture
    it. Returns the graph and what ``fn`` returned during the capture: tensors in the graph's memory, written by
    each replay and not before the first one (capturing records work, it does not run it). ``mode``: CUDA's
    capture mode; ``"thread_local"`` for a capture while other threads may use the GPU (they are not refused)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
        out = fn()
    return graph, out


def capture_checked(
    forward: Callable[[], torch.Tensor], slots, size: int, pool=None, refresh: Callable[[], None] | None = None
):
    """Capture ``forward`` (a step on an all-padding batch, whose state lives in the scratch slot of ``slots``),
    replay it once and compare with an eager run; raises on any difference. The capture's warm-up run, the eager
    reference and the replay each start from the same scratch state, and from freshly written static inputs:
    ``refresh()`` runs before each of them (a step may write its inputs in place, as a prefill's first layer does
    its embeddings, the residual; a real replay rewrites them too). Returns (graph, its output)."""
    scratch = [slots.scratch]
    refresh = refresh or (lambda: None)
    refresh()
    with slots.preserved(scratch):
        graph, out = capture_graph(forward, pool)
    refresh()
    with slots.preserved(scratch):
        want = forward().clone()
    refresh()
    with slots.preserved(scratch):
        graph.replay()
    if not torch.equal(out, want):
        raise RuntimeError(f"replay of bucket {size} differs from eager: {out.tolist()} vs {want.tolist()}")
    return graph, out


def graph_pool() -> torch.cuda.MemPool:
    """A memory pool for a runner's graphs that lives as long as the returned object. A bare
    ``graph_pool_handle()`` pool lives only as long as its graphs: a first capture that fails its check drops
    the only graph, the pool goes with it, and every later capture into the handle trips an allocator assert.
    Pass ``.id`` as ``pool``; keep the object while the graphs live."""
    return torch.cuda.MemPool()


def capture_buckets(
    sizes: Iterable[int], capture_one: Callable[[int], T], what: str
) -> tuple[dict[int, T], dict[int, str]]:
    """Capture and verify one bucket at a time, largest first (smaller ones then reuse the shared pool's
    memory). ``capture_one(size)`` captures, replays and checks the replay against eager, raising on any
    difference. A bucket that raises is left out with one warning: its batches run eagerly, never wrongly.

    Returns (captured: size -> what ``capture_one`` returned, failed: size -> reason).
    """
    if not local_graphs_allowed_now():
        raise RuntimeError(f"{what}s cannot be captured while another CUDA graph is being captured")
    captured: dict[int, T] = {}
    failed: dict[int, str] = {}
    for size in sorted(set(sizes), reverse=True):
        try:
            captured[size] = capture_one(size)
        except Exception as exc:  # noqa: BLE001 - any failure means: this bucket runs eagerly
            failed[size] = f"{type(exc).__name__}: {exc}"
            logger.warning("%s capture failed for bucket %d (%s); that bucket runs eagerly", what, size,
                           failed[size])  # fmt: skip
    return captured, failed


def median_ms(fn: Callable[[], object], iters: int = 10, warmup: int = 1) -> float:
    """Median milliseconds of one ``fn()`` on the current stream, timed with CUDA events; warm-up excluded."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
