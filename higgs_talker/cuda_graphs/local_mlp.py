"""Local MLP graphs: per layer, ``post_attention_layernorm (fused add) + mlp`` replayed from a CUDA graph.

Attention and everything else stay eager. Graphs are captured at warm-up for padded batch buckets (largest
first, one shared memory pool), each replayed once right after capture and compared with eager before it is
trusted; they are never captured in the serving path. Every bucket has one static input/output buffer set
shared by all its layers. A bucket whose capture fails is dropped with one warning and runs eagerly. The same
class serves our engine and the vLLM adapter (over vLLM's Qwen3 layers).

At run time ``step_hook`` gives the eager block (the caller's forward runs eagerly) for a batch no bucket holds,
for a bucket that failed, and whenever the current stream is capturing (an outer full-decode or vLLM graph):
replaying inside a capture raises "Cannot prepare for replay during capturing stage".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..model import forward_layers, post_attention_block
from .buckets import DEFAULT_BUCKETS, bucket_for, normalize_buckets
from .capture import capture_buckets, capture_graph, graph_pool
from .policy import local_graphs_allowed_now

logger = logging.getLogger(__name__)

# (layer index, hidden [B, H], residual [B, H]) -> (mlp output [B, H], new residual [B, H])
PostAttentionFn = Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]]


class _Bucket:
    def __init__(self, size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.size = size
        self.hidden = torch.zeros(size, hidden_size, dtype=dtype, device=device)
        self.residual = torch.zeros(size, hidden_size, dtype=dtype, device=device)
        self.out = torch.zeros(size, hidden_size, dtype=dtype, device=device)
        self.res_out = torch.zeros(size, hidden_size, dtype=dtype, device=device)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._views: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    def views(self, rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(hidden, residual, out, res_out) cut to the first ``rows`` rows, made once per row count."""
        views = self._views.get(rows)
        if views is None:
            views = self._views[rows] = (self.hidden[:rows], self.residual[:rows], self.out[:rows], self.res_out[:rows])
        return views


class LocalMLPGraphs:
    """Graphs of ``post_attention(layer, hidden, residual)`` for every layer and bucket.

    ``post_attention`` is the eager block (it may update its inputs in place, as FlashInfer's fused add +
    RMSNorm does); the graph copies its results into the bucket's static outputs.
    """

    def __init__(
        self,
        post_attention: PostAttentionFn,
        num_layers: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        pool=None,
        forward_context: Callable[[], object] | None = None,
    ) -> None:
        self.post_attention = post_attention
        self.num_layers = num_layers
        self.requested = normalize_buckets(buckets)
        self.pool = pool
        self.forward_context = forward_context  # e.g. vLLM's get_forward_context, for the run-time guard
        self.buckets: dict[int, _Bucket] = {}
        self.failed: dict[int, str] = {}

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.buckets))

    def capture(
        self, hidden_size: int, dtype: torch.dtype, device: torch.device, sizes: Sequence[int] | None = None
    ) -> None:
        """Capture and check every bucket (or those of ``sizes``; a later call adds buckets), largest first. Must run
        outside any stream capture."""
        if self.pool is None:  # a pool of their own, kept alive with them
            self._pool_owner = graph_pool()
            self.pool = self._pool_owner.id

        def capture_one(size: int) -> _Bucket:
            bucket = _Bucket(size, hidden_size, dtype, device)
            for layer in range(self.num_layers):
                graph, _ = capture_graph(lambda layer=layer: self._record(bucket, layer), self.pool)
                bucket.graphs.append(graph)
                self._check_layer(bucket, layer)
            return bucket

        buckets, failed = capture_buckets(self.requested if sizes is None else sizes, capture_one, "local MLP graph")
        self.buckets |= buckets
        self.failed |= failed

    def _record(self, bucket: _Bucket, layer: int) -> None:
        out, res = self.post_attention(layer, bucket.hidden, bucket.residual)
        bucket.out.copy_(out)
        bucket.res_out.copy_(res)

    def _check_layer(self, bucket: _Bucket, layer: int) -> None:
        """Replay on fresh random inputs and compare with the eager block (same kernels and shapes: near equal)."""
        g = torch.Generator(device=bucket.hidden.device).manual_seed(layer)
        hidden = torch.randn(bucket.hidden.shape, generator=g, device=bucket.hidden.device).to(bucket.hidden.dtype)
        residual = torch.randn(bucket.hidden.shape, generator=g, device=bucket.hidden.device).to(bucket.hidden.dtype)
        want_out, want_res = (t.clone() for t in self.post_attention(layer, hidden.clone(), residual.clone()))
        bucket.hidden.copy_(hidden)
        bucket.residual.copy_(residual)
        bucket.graphs[layer].replay()
        for name, got, want in (("output", bucket.out, want_out), ("residual", bucket.res_out, want_res)):
            if not torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-3):
                err = (got.float() - want.float()).abs().max().item()
                raise RuntimeError(f"layer {layer} replay {name} differs from eager (max abs err {err:.3g})")

    def post_attention_or_eager(self, layer: int, hidden: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """The model's post-attention hook: this layer's graph when one applies, else the eager block."""
        return self.step_hook(hidden.shape[0])(layer, hidden, residual)

    def step_hook(self, rows: int) -> PostAttentionFn:
        """``post_attention_or_eager`` for one forward of ``rows`` rows, with its bucket and the run-time guard
        settled once for all layers (neither changes within a forward): the bucket's graphs, or the eager block
        where none applies now. Settling them at every layer cost an eager step host time (three times the
        copies and replay themselves: ``benchmarks/probes/local_mlp_host.py``)."""
        size = bucket_for(rows, self.sizes)
        if size is None or not local_graphs_allowed_now(self.forward_context() if self.forward_context else None):
            return self.post_attention
        bucket = self.buckets[size]
        hidden_in, residual_in, out, res_out = bucket.views(rows)
        graphs = bucket.graphs

        def replay(layer: int, hidden: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
            hidden_in.copy_(hidden)
            residual_in.copy_(residual)
            graphs[layer].replay()
            return out, res_out

        return replay


class LocalMLPPath:
    """The local MLP graphs over a stack of Qwen3 layers that is not our runner's (the vLLM adapter's: vLLM's
    layers have our layers' shape), with its final ``norm``. Captured once by ``capture``; ``forward`` runs the
    stack with the graph hook for a pure decode step that a bucket holds, and returns None otherwise (the caller
    runs its own backbone)."""

    def __init__(self, layers: Sequence[nn.Module], norm: nn.Module, enabled: bool, max_batch: int,
                 forward_context: Callable[[], object] | None = None) -> None:  # fmt: skip
        self.layers, self.norm, self.enabled, self.max_batch = list(layers), norm, enabled, max_batch
        self.forward_context = forward_context
        self.graphs: LocalMLPGraphs | None = None
        self.replays = 0  # decode steps that ran through the graphs

    def _post_attention(self, i: int, hidden: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return post_attention_block(self.layers[i], hidden, residual)

    def capture(self, hidden_size: int, like: Tensor) -> None:
        """Capture (once, after the weights are loaded) when enabled and ``like`` is on CUDA; dtype/device of it."""
        if not self.enabled or self.graphs is not None or like.device.type != "cuda":
            return
        buckets = [b for b in DEFAULT_BUCKETS if b <= self.max_batch] or [1]
        graphs = LocalMLPGraphs(self._post_attention, len(self.layers), buckets, forward_context=self.forward_context)
        with torch.inference_mode():
            graphs.capture(hidden_size, like.dtype, like.device)
        self.graphs = graphs
        logger.info("local MLP graphs captured for batch buckets %s", graphs.sizes)

    def forward(self, positions: Tensor, embeds: Tensor, pure_decode: bool) -> Tensor | None:
        """embeds [T, H] -> final hidden [T, H] through the graphed layers, or None (not a step they cover)."""
        graphs = self.graphs
        if graphs is None or not pure_decode:
            return None
        hook = graphs.step_hook(embeds.shape[0])
        if hook is graphs.post_attention:  # no bucket holds the step, or a graph is captured or replayed around it
            return None
        hidden, residual = forward_layers(self.layers, positions, embeds, hook)
        self.replays += 1
        return self.norm(hidden, residual)[0]

    def report(self) -> dict:
        """What the path did: decode steps replayed, buckets captured, buckets whose capture failed (why)."""
        g = self.graphs
        failed = {str(k): str(v) for k, v in g.failed.items()} if g else {}
        return {"replays": self.replays, "buckets": list(g.sizes) if g else [], "failed": failed}
