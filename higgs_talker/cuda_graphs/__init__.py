"""CUDA graphs: the mode policy, batch buckets, the capture recipe, kernel choice by measurement, local MLP
graphs, full decode-step graphs, prefill graphs, the vLLM adapter's frame graphs, and the graph runner that wraps a
``ModelRunner``.

Nothing here imports the engine or the scheduler: the graph runner has the model runner's
``run(batch) -> rows`` contract.
"""

from .buckets import DEFAULT_BUCKETS, PREFILL_BUCKETS
from .policy import GraphDecision, GraphMode, decide, local_graphs_allowed_now
from .runner import GraphRunner

__all__ = [
    "DEFAULT_BUCKETS",
    "PREFILL_BUCKETS",
    "GraphDecision",
    "GraphMode",
    "GraphRunner",
    "decide",
    "local_graphs_allowed_now",
]
