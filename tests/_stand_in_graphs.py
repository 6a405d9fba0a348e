"""A stand-in for CUDA graph capture on CPU: the captured function runs again on each replay, reading the same
static tensors, so everything around a graph (static inputs refreshed before a replay, capture checks,
variant choice) can be tested without a GPU. ``tests/test_gpu.py`` replays real graphs."""

from __future__ import annotations

import torch


class ReplayedGraph:
    """Stands in for a captured CUDA graph: ``replay`` runs the function again into the captured output."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self) -> None:
        self.replays += 1
        out = self.fn()
        if self.out is not None:  # a function that writes its own static outputs returns None
            self.out.copy_(out)


def stand_in_capture(fn, pool=None, mode="global"):
    out = fn()
    return ReplayedGraph(fn, out), out
