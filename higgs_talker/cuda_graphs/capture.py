"""The one capture recipe every graph here uses."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
logger = logging.getLogger(__name__)


def capture_graph(fn: Callable[[], T], pool=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``fn`` once on a side stream (lazy initialisation and autotuning stay out of the graph), then capture
    it. Returns the graph and what ``fn`` returned during the capture: tensors in the graph's memory, written by
    each replay and not before the first one (capturing records work, it does not run it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def record_capture_failure(failed: dict[int, str], what: str, size: int, exc: BaseException) -> None:
    """A bucket whose capture (or replay check) failed: remember why and warn once; its batches run eagerly."""
    failed[size] = f"{type(exc).__name__}: {exc}"
    logger.warning("%s capture failed for batch bucket %d (%s); that bucket runs eagerly", what, size, failed[size])
