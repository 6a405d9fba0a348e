"""Full decode-step graphs: ``ModelRunner.forward`` of a padded decode batch (feedback embedding, every layer,
the codebook head, delay masks, sampling, state update) captured as one CUDA graph per batch bucket.

This is our engine's analogue of vLLM's FULL_DECODE_ONLY. Each bucket is captured on an all-padding batch
(every row on the scratch slot and scratch KV block, so capturing touches no request's state), replayed once
and compared with an eager run on the same inputs; a bucket that fails either is dropped with one warning and
its batches run eagerly. A graph's static inputs are views of one ``[2, size]`` buffer (slots, positions),
refreshed by one copy per replay; the attention backend's ``plan_bucket`` refreshes the rest.

The graph of a bucket (``graphs``) samples with the whole sampler, so it serves any batch. Each bucket also gets
two cheaper variants (``variants``), used where the batch allows them: one for batches with no top-k / top-p
(no sort and filter), one for all-greedy batches (the argmax of the masked logits only, no noise). They skip
only work whose result those batches do not use (``StepBatch.draw`` / ``filter``), so every variant gives the
rows the whole sampler gives. A variant that fails to capture leaves its batches on the bucket's graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..batch import DeviceBatch, StepBatch
from .buckets import normalize_buckets
from .capture import capture_buckets, capture_checked, graph_pool

if TYPE_CHECKING:
    from ..model_runner import ModelRunner


@dataclass
class _Graph:
    packed: Tensor  # [2, size] int64: the static slots and positions the graph reads
    graph: torch.cuda.CUDAGraph
    out: Tensor  # [size, C + 1] int64, written by each replay


SAMPLER_VARIANTS = ((True, False), (False, False))  # (draw, filter) beside the whole sampler's (True, True)


class FullDecodeGraphs:
    def __init__(self, runner: ModelRunner, buckets: Sequence[int], pool=None) -> None:
        self.runner = runner
        self.requested = normalize_buckets(buckets)
        self.pool = pool
        self.graphs: dict[int, _Graph] = {}  # bucket -> graph of the whole sampler
        self.failed: dict[int, str] = {}
        self.variants: dict[tuple[int, bool, bool], _Graph] = {}  # (bucket, draw, filter) -> cheaper sampler
        self.failed_variants: dict[tuple[int, bool, bool], str] = {}

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    def capture(self, sizes: Sequence[int] | None = None) -> None:
        """Capture and check the graphs of ``sizes`` (default: every requested bucket) and their variants; a later
        call adds buckets."""
        if self.pool is None:  # a pool of their own, kept alive with them
            self._pool_owner = graph_pool()
            self.pool = self._pool_owner.id
        graphs, failed = capture_buckets(self.requested if sizes is None else sizes, self._capture_one,
                                         "full decode graph")  # fmt: skip
        self.graphs |= graphs
        self.failed |= failed
        for draw, filter in SAMPLER_VARIANTS:
            captured, failed = capture_buckets(
                sorted(graphs), lambda size, d=draw, f=filter: self._capture_one(size, d, f),
                f"full decode graph (draw={draw}, filter={filter})",
            )  # fmt: skip
            self.variants |= {(size, draw, filter): g for size, g in captured.items()}
            self.failed_variants |= {(size, draw, filter): why for size, why in failed.items()}

    def _capture_one(self, size: int, draw: bool = True, filter: bool = True) -> _Graph:
        runner = self.runner
        padding = runner.padding_batch(size)
        packed = padding.decode_packed().to(runner.device)
        inputs = DeviceBatch.decode(packed, draw, filter)
        runner.attn.plan_bucket(padding)
        graph, out = capture_checked(lambda: runner.forward(inputs), runner.slots, size, self.pool)
        return _Graph(packed, graph, out)

    def run(self, batch: StepBatch) -> Tensor:
        """Replay the graph of a decode batch already padded to one of ``sizes`` -> rows [size, C + 1] (a view
        valid until the bucket's next replay)."""
        size = batch.num_reqs
        g = self.variants.get((size, batch.draw, batch.filter and batch.draw)) or self.graphs[size]
        g.packed.copy_(batch.decode_packed(), non_blocking=True)
        self.runner.attn.plan_bucket(batch)
        g.graph.replay()
        return g.out
