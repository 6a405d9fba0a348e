"""The engine's graph runner: builds the graph sets the policy asks for and picks one per decode step.

- ``local_mlp``: local MLP graphs; attention eager.
- ``full_decode``: full decode-step graphs; the local path is off (policy).
- ``auto``: both sets, one pool. At warm-up each bucket times a full-graph replay against an eager step with
  local MLP graphs (same padded batch) and keeps the faster; a step then uses exactly one of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .buckets import DEFAULT_BUCKETS, bucket_for, normalize_buckets
from .full_decode import FullDecodeGraphs
from .local_mlp import LocalMLPGraphs
from .policy import GraphMode, decide

if TYPE_CHECKING:
    from ..attention import AttnMetadata
    from ..engine import DecodeInputs, Engine

logger = logging.getLogger(__name__)


class GraphRunner:
    def __init__(self, engine: Engine, mode: GraphMode | str, buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        self.engine = engine
        self.decision = decide(mode=mode)
        self.mode = self.decision.mode
        self.buckets = normalize_buckets(buckets, engine.ecfg.max_num_seqs)
        self.pool = None
        self.local: LocalMLPGraphs | None = None
        self.full: FullDecodeGraphs | None = None
        self.choice: dict[int, str] = {}  # bucket -> "full_decode" | "local_mlp" (auto)
        self.timings: list[dict] = []
        self.warmup_s = 0.0

    def warm_up(self) -> None:
        """Capture every graph the mode needs, before the first request (nothing to capture in eager mode)."""
        eng = self.engine
        logger.info("graph policy: %s", self.decision.reason)
        if not (self.decision.full_decode or self.decision.local_mlp):
            return
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        if self.decision.full_decode:
            self.full = FullDecodeGraphs(eng, self.buckets, self.pool)
            self.full.capture()
        if self.decision.local_mlp:
            self.local = LocalMLPGraphs(
                eng.eager_post_attention, eng.cfg.text.num_hidden_layers, self.buckets, self.pool
            )
            self.local.capture(eng.cfg.hidden_size, eng.dtype, eng.device)
        if self.mode is GraphMode.AUTO:
            self._choose()
        torch.cuda.synchronize()
        self.warmup_s = time.perf_counter() - start
        logger.info(
            "CUDA graph warm-up (%s, buckets %s) took %.1f s", self.mode.value, list(self.buckets), self.warmup_s
        )

    def _choose(self) -> None:
        """auto: per bucket, time both paths on a padded batch and keep the faster (measured, not guessed)."""
        eng = self.engine
        for size in self.buckets:
            full_ok = self.full is not None and size in self.full.slots
            local_ok = self.local is not None and size in self.local.buckets
            if not (full_ok and local_ok):
                self.choice[size] = "full_decode" if full_ok else "local_mlp"
                continue
            inputs = self.full.padding_inputs(size)
            rows = torch.tensor([eng.scratch_row], device=eng.device)
            saved = eng.state.gather(rows)

            def full_step(size=size):
                eng.attn.begin_graph(None, size)
                self.full.slots[size].graph.replay()

            def local_step(inputs=inputs, size=size):
                eng.attn.begin_graph(None, size)
                eng.decode_forward(inputs, self.post_attention)

            t_full, t_local = _median_ms(full_step), _median_ms(local_step)
            eng.state.scatter(rows, saved)
            self.choice[size] = "full_decode" if t_full <= t_local else "local_mlp"
            self.timings.append(
                {"bucket": size, "full_decode_ms": t_full, "local_mlp_ms": t_local, "chosen": self.choice[size]}
            )
        table = ", ".join(
            f"{t['bucket']}: full {t['full_decode_ms']:.2f} / local {t['local_mlp_ms']:.2f} ms" for t in self.timings
        )
        logger.info("auto graph mode per bucket: %s", table or "only one path available")

    def post_attention(self, layer: int, hidden: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """The model's post-attention hook: a local MLP graph when one applies, else the eager block."""
        if self.local is not None:
            out = self.local.run(layer, hidden, residual)
            if out is not None:
                return out
        return self.engine.eager_post_attention(layer, hidden, residual)

    def path_for(self, size: int) -> str:
        """The path a decode batch of bucket ``size`` takes: full_decode, local_mlp or eager."""
        full = self.full is not None and size in self.full.slots
        if full and (self.mode is not GraphMode.AUTO or self.choice.get(size) == "full_decode"):
            return "full_decode"
        if self.local is not None and size in self.local.buckets:
            return "local_mlp"
        return "eager"

    def decode(self, inputs: DecodeInputs, meta: AttnMetadata) -> Tensor:
        """Run one decode step; returns emitted rows [B, N].

        Batches are padded to their bucket on every path, eager included, so all modes launch the same kernels
        on the same shapes (and give the same codes). Batches above the largest bucket run eagerly, unpadded.
        """
        eng = self.engine
        b = len(meta.seq_lens_host)
        size = bucket_for(b, self.buckets)
        if size is None:
            eng.attn.begin(meta)
            return eng.decode_forward(inputs, None)
        inputs, meta = eng.pad_decode(inputs, meta, size)
        path = self.path_for(size)
        if path == "full_decode":
            return self.full.run(inputs, meta)[:b]
        eng.attn.begin_graph(meta, size)
        return eng.decode_forward(inputs, self.post_attention if path == "local_mlp" else None)[:b]


def _median_ms(fn, iters: int = 10) -> float:
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
    return sorted(times)[len(times) // 2]
