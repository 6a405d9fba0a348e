"""Prefill graphs: ``ModelRunner.forward`` of a prefill batch padded to a token bucket (every layer, the codebook head,
delay masks, sampling, state update) captured as one CUDA graph per bucket.

A prefill runs once per request, but eagerly its ~10 launches a layer cost the host several times what the GPU needs
for a short prompt (H200, 4B: a 32-token prefill took 18.8 ms on the host for 3.2 ms of kernels; replayed 4.5 ms:
benchmarks/results/h200_20261202/profile_prefill_20261202-0018.log), and it comes before
the first frame. The padding rule is ``StepBatch.padded_prefill``: a bucket has a fixed token count and a fixed
request count (as many as it could hold, plus the padding request). The token embedding runs eagerly before the
replay (how many audio rows a prompt has varies) into the graph's static ``embeds``; the integer inputs are views of
one buffer (``StepBatch.prefill_packed``), refreshed by one copy per replay; the attention backend's
``plan_prefill_bucket`` refreshes the rest. The step writes ``embeds`` in place (the first layer's residual add), so
they are rewritten before every replay and every run of the capture check. Capture and checking follow the full
decode graphs: on an all-padding batch, one replay compared with an eager run; a bucket that fails is dropped with
one warning (the graph runner then runs that bucket's padded batches eagerly). A prefix-cache hit replays the same
graph: its queries fill the bucket, its cached context is only read, through the attention plan.
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
    packed: Tensor  # [2 T + 2 R] int64: token ids, positions, last tokens, slots (StepBatch.prefill_packed)
    embeds: Tensor  # [T, H]: the tokens' embeddings, written before each replay
    graph: torch.cuda.CUDAGraph
    out: Tensor  # [R, C + 1] int64, written by each replay


class PrefillGraphs:
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
        if self.pool is None:  # a pool of their own, kept alive with them
            self._pool_owner = graph_pool()
            self.pool = self._pool_owner.id
        self.graphs, self.failed = capture_buckets(self.requested, self._capture_one, "prefill graph")

    def _capture_one(self, tokens: int) -> _Graph:
        runner = self.runner
        padding = runner.prefill_padding_batch(tokens)
        packed = padding.prefill_packed().to(runner.device)
        embeds = torch.zeros(tokens, runner.cfg.hidden_size, dtype=runner.dtype, device=runner.device)
        inputs = DeviceBatch.prefill(packed, tokens, embeds=embeds)
        fresh = runner.embed_prompt(inputs)
        runner.attn.plan_prefill_bucket(padding)
        graph, out = capture_checked(
            lambda: runner.forward(inputs), runner.slots, tokens, self.pool, refresh=lambda: embeds.copy_(fresh)
        )
        return _Graph(packed, embeds, graph, out)

    def run(self, batch: StepBatch) -> Tensor:
        """Replay the graph of a prefill batch already padded to one of ``sizes`` tokens (its new streams already
        reset) -> rows [R, C + 1] (a view valid until the bucket's next replay)."""
        runner = self.runner
        g = self.graphs[batch.num_tokens]
        g.packed.copy_(batch.prefill_packed(), non_blocking=True)
        inputs = DeviceBatch.prefill(g.packed, batch.num_tokens, *batch.audio_to(runner.device))
        g.embeds.copy_(runner.embed_prompt(inputs))
        runner.attn.plan_prefill_bucket(batch)
        g.graph.replay()
        return g.out
