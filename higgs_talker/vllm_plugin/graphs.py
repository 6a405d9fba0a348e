"""The local MLP graph path over vLLM's Qwen3 layers (CUDA only; the graphs are ``cuda_graphs.local_mlp``'s).

On when ``cuda_graphs.policy.decide(vllm_config=...)`` says so (vLLM captures no graphs of its own), captured
once after the weights are loaded, and used only for pure decode steps that a captured bucket holds and while
the run-time guard allows it (no stream capture, no vLLM FULL graph in the forward context). vLLM's layers have
our layers' shape, so ``model.forward_layers`` runs them with the graph hook; anything else returns None and the
caller runs vLLM's ``Qwen3Model`` unchanged.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from ..cuda_graphs.buckets import DEFAULT_BUCKETS
from ..cuda_graphs.local_mlp import LocalMLPGraphs
from ..cuda_graphs.policy import local_graphs_allowed_now
from ..model import forward_layers, post_attention_block
from .compat import forward_context

logger = logging.getLogger(__name__)


class LocalMLPPath:
    """Per-layer ``post_attention_layernorm + mlp`` graphs for a vLLM ``Qwen3Model`` (``model.layers``)."""

    def __init__(self, model: nn.Module, enabled: bool, max_batch: int) -> None:
        self.model = model
        self.enabled = enabled
        self.max_batch = max_batch
        self.graphs: LocalMLPGraphs | None = None
        self.replays = 0  # decode steps that ran through the graphs

    @property
    def layers(self) -> list[nn.Module]:
        return list(self.model.layers[self.model.start_layer : self.model.end_layer])

    def _post_attention(self, layer_idx: int, hidden: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return post_attention_block(self.model.layers[self.model.start_layer + layer_idx], hidden, residual)

    def capture(self, hidden_size: int, like: Tensor) -> None:
        """Capture the graphs (once, after loading) when the policy enabled the path and CUDA is there."""
        if not self.enabled or self.graphs is not None or like.device.type != "cuda":
            return
        buckets = [b for b in DEFAULT_BUCKETS if b <= self.max_batch] or [1]
        graphs = LocalMLPGraphs(self._post_attention, len(self.layers), buckets, forward_context=forward_context)
        with torch.inference_mode():
            graphs.capture(hidden_size, like.dtype, like.device)
        self.graphs = graphs
        logger.info("local MLP graphs captured for batch buckets %s", graphs.sizes)

    def forward(self, positions: Tensor, embeds: Tensor, pure_decode: bool) -> Tensor | None:
        """Final hidden [T, H] through the graphed layers, or None (the caller runs the backbone)."""
        graphs = self.graphs
        if graphs is None or not pure_decode or not graphs.sizes or embeds.shape[0] > max(graphs.sizes):
            return None
        if not local_graphs_allowed_now(forward_context()):
            return None
        hidden, residual = forward_layers(self.layers, positions, embeds, graphs.post_attention_or_eager)
        self.replays += 1
        hidden, _ = self.model.norm(hidden, residual)
        return hidden
