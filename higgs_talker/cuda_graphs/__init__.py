"""CUDA graphs: the mode policy, padded batch buckets, local MLP graphs and full decode-step graphs."""

from .policy import GraphDecision, GraphMode, decide, local_graphs_allowed_now

__all__ = ["GraphDecision", "GraphMode", "decide", "local_graphs_allowed_now"]
