"""The local MLP graph path over vLLM's Qwen3 layers (CUDA only; the capture code is ``cuda_graphs.local_mlp``).

On when ``cuda_graphs.policy.decide(vllm_config=...)`` says so (vLLM captures no graphs of its own), captured
once after the weights are loaded, and used only for pure decode steps that a captured bucket holds and
while the run-time guard allows it (no stream capture, no vLLM FULL graph in the forward context). Anything
else returns None and the caller runs vLLM's ``Qwen3Model`` unchanged.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def _forward_context():
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None


class LocalMLPPath:
    """Per-layer ``post_attention_layernorm + mlp`` graphs for a vLLM ``Qwen3Model`` (``model.layers``)."""

    def __init__(self, model: nn.Module, enabled: bool, max_batch: int) -> None:
        self.model = model
        self.enabled = enabled
        self.max_batch = max_batch
        self.graphs = None

    def _post_attention(self, layer_idx: int, hidden: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        layer = self.model.layers[self.model.start_layer + layer_idx]
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        return layer.mlp(hidden), residual

    def capture(self, hidden_size: int, like: Tensor) -> None:
        """Capture the graphs (once, after loading) when the policy enabled the path and CUDA is there."""
        if not self.enabled or self.graphs is not None or like.device.type != "cuda":
            return
        try:
            from ..cuda_graphs.local_mlp import LocalMLPGraphs
        except ImportError as exc:  # the capture module is not there: stay eager
            logger.warning("local MLP graphs unavailable (%s); running eagerly", exc)
            self.enabled = False
            return
        from ..cuda_graphs.buckets import DEFAULT_BUCKETS

        buckets = [b for b in DEFAULT_BUCKETS if b <= self.max_batch] or [1]
        num_layers = self.model.end_layer - self.model.start_layer
        graphs = LocalMLPGraphs(self._post_attention, num_layers, buckets, forward_context=_forward_context)
        with torch.inference_mode():
            graphs.capture(hidden_size, like.dtype, like.device)
        self.graphs = graphs
        logger.info("local MLP graphs captured for batch buckets %s", graphs.sizes)

    def forward(self, positions: Tensor, embeds: Tensor, pure_decode: bool) -> Tensor | None:
        """Final hidden [T, H] through the graphed layers, or None (the caller runs the backbone)."""
        if self.graphs is None or not pure_decode or not self.graphs.sizes:
            return None
        if embeds.shape[0] > max(self.graphs.sizes):
            return None
        from ..cuda_graphs.policy import local_graphs_allowed_now

        if not local_graphs_allowed_now(_forward_context()):
            return None
        hidden, residual = embeds, None
        for i, layer in enumerate(self.model.layers[self.model.start_layer : self.model.end_layer]):
            if residual is None:
                residual = hidden
                hidden = layer.input_layernorm(hidden)
            else:
                hidden, residual = layer.input_layernorm(hidden, residual)
            hidden = layer.self_attn(positions=positions, hidden_states=hidden)
            out = self.graphs.run(i, hidden, residual)
            hidden, residual = out if out is not None else self._post_attention(i, hidden, residual)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden
