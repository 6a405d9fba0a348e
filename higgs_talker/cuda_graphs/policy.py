"""The one place that decides graph modes.

``decide(mode=..., vllm_config=...)`` is a pure function: it reads our engine's mode and/or a vLLM config
object (duck-typed; vLLM is never imported) and returns whether the local MLP graph path may run, plus the
reason, which callers log once. It never mutates the config it reads.

``local_graphs_allowed_now()`` is the run-time guard: no local graph is captured or replayed while the
current CUDA stream is capturing (an outer full-decode or vLLM capture), because PyTorch raises
"Cannot prepare for replay during capturing stage" there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..heads.fused import stream_is_capturing


class GraphMode(str, Enum):
    EAGER = "eager"
    LOCAL_MLP = "local_mlp"
    FULL_DECODE = "full_decode"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: GraphMode | str) -> GraphMode:
        if isinstance(value, GraphMode):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown graph mode {value!r}; choose one of {names}") from None


# vLLM CUDAGraphMode names that capture decode steps outside our control
VLLM_GRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass(frozen=True)
class GraphDecision:
    """Whether the local MLP graph path is on, whether full-decode graphs are ours to capture, whether prefill
    graphs may be (where buckets are asked for), and why."""

    mode: GraphMode
    local_mlp: bool
    full_decode: bool
    reason: str
    full_prefill: bool = False


def vllm_cudagraph_mode_name(vllm_config: Any) -> str | None:
    """The name of ``compilation_config.cudagraph_mode`` (enum member or string), upper-cased; None if unset."""
    comp = getattr(vllm_config, "compilation_config", None)
    mode = getattr(comp, "cudagraph_mode", None)
    if mode is None:
        return None
    name = getattr(mode, "name", None) or str(mode)
    name = name.rsplit(".", 1)[-1].upper()  # "CUDAGraphMode.FULL" -> "FULL"
    return name


def vllm_captures_graphs(vllm_config: Any) -> tuple[bool, str]:
    """Does vLLM capture CUDA graphs around the model under this config? (decision, explanation)."""
    model_config = getattr(vllm_config, "model_config", None)
    enforce_eager = getattr(model_config, "enforce_eager", True)  # missing counts as eager, like upstream
    name = vllm_cudagraph_mode_name(vllm_config)
    if enforce_eager:
        return False, "vLLM enforce_eager=True: vLLM captures no CUDA graphs"
    if name is None or name == "NONE":
        return False, f"vLLM cudagraph_mode={name or 'unset'}: vLLM captures no CUDA graphs"
    return True, f"vLLM captures CUDA graphs (enforce_eager=False, cudagraph_mode={name})"


def decide(mode: GraphMode | str | None = None, vllm_config: Any = None) -> GraphDecision:
    """Decide the graph paths for our engine (``mode``) or for the vLLM adapter (``vllm_config``).

    Under vLLM, the local MLP path is on exactly when vLLM captures no graphs of its own; ``mode`` may then
    still turn it off ("eager"). Without vLLM, ``mode`` alone decides: eager (none), local_mlp (local only),
    full_decode (our full-step graphs, local off), auto (both kinds captured, never both in one step). Prefill
    graphs (opt-in by token buckets) go with the modes that capture whole steps: full_decode and auto.
    """
    if vllm_config is not None:
        external, why = vllm_captures_graphs(vllm_config)
        requested = GraphMode.parse(mode) if mode is not None else GraphMode.LOCAL_MLP
        if external:
            return GraphDecision(requested, False, False, f"local MLP graphs off: {why}")
        if requested is GraphMode.EAGER:
            return GraphDecision(requested, False, False, f"local MLP graphs off: mode=eager ({why})")
        return GraphDecision(requested, True, False, f"local MLP graphs on: {why}")
    m = GraphMode.parse(mode if mode is not None else GraphMode.EAGER)
    if m is GraphMode.EAGER:
        return GraphDecision(m, False, False, "mode=eager: no CUDA graphs")
    if m is GraphMode.LOCAL_MLP:
        return GraphDecision(m, True, False, "mode=local_mlp: per-layer MLP graphs, attention eager")
    if m is GraphMode.FULL_DECODE:
        return GraphDecision(
            m, False, True, "mode=full_decode: whole decode-step graphs, local MLP graphs off", full_prefill=True
        )
    return GraphDecision(
        m, True, True, "mode=auto: per bucket, the faster of full-decode and local MLP graphs (measured)",
        full_prefill=True,
    )  # fmt: skip


def local_graphs_allowed_now(forward_context: Any = None) -> bool:
    """Run-time guard for the local MLP path: False while a stream capture (or a vLLM FULL graph) is active.

    ``forward_context`` is optionally vLLM's ForwardContext; a ``cudagraph_runtime_mode`` other than NONE
    means vLLM is capturing or replaying a graph around us.
    """
    if stream_is_capturing():
        return False
    runtime = getattr(forward_context, "cudagraph_runtime_mode", None)
    if runtime is not None:
        name = (getattr(runtime, "name", None) or str(runtime)).rsplit(".", 1)[-1].upper()
        if name != "NONE":
            return False
    return True
