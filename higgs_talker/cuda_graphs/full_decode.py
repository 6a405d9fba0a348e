"""Full decode-step graphs: ``ModelRunner.forward`` of a padded decode batch (feedback embedding, every layer,
the codebook head, delay masks, sampling, state update) captured as one CUDA graph per batch bucket.

This is our engine's analogue of vLLM's FULL_DECODE_ONLY. Each bucket is captured on an all-padding batch
(every row on the scratch slot and scratch KV block, so capturing touches no request's state), replayed once
and compared with an eager run on the same inputs; a bucket that fails either is dropped with one warning and
its batches run eagerly. A graph's static inputs are views of one ``[2, size]`` buffer (slots, positions),
refreshed by one copy per replay; the attention backend's ``plan_bucket`` refreshes the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..batch import DeviceBatch, StepBatch
from .buckets import normalize_buckets
from .capture import capture_buckets, capture_graph

if TYPE_CHECKING:
    from ..model_runner import ModelRunner


@dataclass
class _Graph:
    packed: Tensor  # [2, size] int64: the static slots and positions the graph reads
    graph: torch.cuda.CUDAGraph
    out: Tensor  # [size, C + 1] int64, written by each replay


class FullDecodeGraphs:
    def __init__(self, runner: ModelRunner, buckets: Sequence[int], pool=None) -> None:
        self.runner = runner
        self.requested = normalize_buckets(buckets)
        self.pool = pool
        self.graphs: dict[int, _Graph] = {}
        self.failed: dict[int, str] = {}

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    def capture(self) -> None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.graphs, self.failed = capture_buckets(self.requested, self._capture_one, "full decode graph")

    def _capture_one(self, size: int) -> _Graph:
        runner = self.runner
        padding = runner.padding_batch(size)
        packed = padding.decode_packed().to(runner.device)
        inputs = DeviceBatch.decode(packed)
        runner.attn.plan_bucket(padding)
        scratch = [runner.slots.scratch]
        # the capture's warm-up run, the eager reference and the replay each start from the same scratch state
        with runner.slots.preserved(scratch):
            graph, out = capture_graph(lambda: runner.forward(inputs), self.pool)
        with runner.slots.preserved(scratch):
            want = runner.forward(inputs).clone()
        with runner.slots.preserved(scratch):
            graph.replay()
        if not torch.equal(out, want):
            raise RuntimeError(f"replay of bucket {size} differs from eager: {out.tolist()} vs {want.tolist()}")
        return _Graph(packed, graph, out)

    def run(self, batch: StepBatch) -> Tensor:
        """Replay the graph of a decode batch already padded to one of ``sizes`` -> rows [size, C + 1] (a view
        valid until the bucket's next replay)."""
        g = self.graphs[batch.num_reqs]
        g.packed.copy_(batch.decode_packed(), non_blocking=True)
        self.runner.attn.plan_bucket(batch)
        g.graph.replay()
        return g.out
