"""Text-only bridge: plain vLLM (no vllm-omni runner) drives the talker through a v1 logits processor.

vLLM's sampler never tells the model whose row is whose; a logits processor hears every batch change
(``update_state``: added with its ``SamplingParams``, removed, moved) before the forward and sees the logits
(``apply``) before sampling, which the bridge turns into the runner's calls. The text token is vLLM's own sample
of logits where only the forced token is finite. ``heads.bridge_requests`` keeps the requests' keys
(``request_args``) and resumes after a preemption; a removed request's slot state is kept (the last 256).
``request_rows`` reads their rows. Use: ``vllm.LLM(..., logits_processors=[TEXT_ONLY_BRIDGE])``.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

from ..heads.bridge_requests import REQUEST_KEY, BridgeRequests, request_args, unsupported
from ..heads.slots import merge_rows
from . import ROWS_EXTENSION
from .compat import collective_rpc_every_engine, warn_once
from .talker import talker_for

__all__ = ["REQUEST_KEY", "RowsWorkerExtension", "TextOnlyBridge", "request_args", "request_rows", "request_rows_async"]


class TextOnlyBridge(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.vllm_config = vllm_config
        self.requests = BridgeRequests()  # by batch index (``heads.bridge_requests``)
        self.armed = False

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """vLLM's per-request check (when a request is added; an HTTP 400 under ``vllm serve``): ValueError naming
        what the bridge cannot honour (``heads.bridge_requests.unsupported``)."""
        if problems := unsupported(sampling_params):
            raise ValueError("the Higgs talker's text-only bridge does not support " + "; ".join(problems))

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the codes of every row, greedy or not

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        model = talker_for(self.vllm_config)
        resume: set[str] = set()  # keys of added requests with generated tokens already: preempted ones come back
        if batch_update is not None:
            finished, resume = self.requests.update(process_dict_updates, batch_update)
            if model is not None and finished:
                model.on_requests_removed(finished)
        self.armed = False
        if model is None:
            warn_once("bridge-no-model", "TextOnlyBridge: no talker was built with this vLLM config; no codes")
        if model is None or self.requests.size == 0:
            return
        model.slots.keep_finished = max(model.slots.keep_finished, 256)
        model.set_bridge_requests(*self.requests.arguments(), resume)
        self.armed = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        model = talker_for(self.vllm_config)
        if self.armed and model is not None and logits.shape[0] == self.requests.size:
            model.sample_codes(*self.requests.params(logits.device))  # normalized by the frame work (row_params)
        self.armed = False
        return logits


class RowsWorkerExtension:
    """A vLLM worker extension (``vllm.LLM(..., worker_extension_cls=ROWS_EXTENSION)``): lets ``request_rows``
    ask worker processes for rows by method name, without sending them a pickled function."""

    def higgs_request_rows(self, keys: list[str]) -> dict[str, list | None]:
        """On a vLLM worker: the rows its adapter holds for ``keys``, as lists (also sent as a function to a worker
        built without the extension: it reads nothing but the worker)."""
        return self.model_runner.get_model().slots.rows_by_key(keys)

    def higgs_adapter_report(self) -> dict:
        """What this worker's talker adapter loaded and did: counters, graph decision, local MLP graphs."""
        talker = self.model_runner.get_model()
        specials = None if talker.specials is None else {"audio": talker.specials.audio, "eos": talker.specials.eos}
        return {"arch_class": type(talker).__module__ + ":" + type(talker).__qualname__, "specials": specials,
                "loaded": sorted(talker.loaded_weight_names), "stats": dict(talker.stats),
                "graph_decision": talker.graph_decision.reason, "local_mlp": talker.local_mlp.report(),
                "frame_graphs": talker.frame_graphs.report() if talker.frame_graphs is not None else None}  # fmt: skip


def request_rows(llm, keys) -> dict[str, torch.Tensor | None]:
    """The code rows [R, C] int32 of the bridge's requests ``keys`` from a ``vllm.LLM``, asked of every worker
    through ``llm.collective_rpc`` (worker processes, e.g. tensor parallel, need the engine built with
    ``worker_extension_cls=ROWS_EXTENSION``). None for a request no worker knows; see ``merge_rows`` for the checks."""
    keys = list(keys)
    extended = llm.llm_engine.vllm_config.parallel_config.worker_extension_cls == ROWS_EXTENSION
    method = "higgs_request_rows" if extended else RowsWorkerExtension.higgs_request_rows
    return merge_rows([llm.collective_rpc(method, args=(keys,))], keys)


async def request_rows_async(engine, keys) -> dict[str, torch.Tensor | None]:
    """``request_rows`` for a ``vllm.v1.engine.async_llm.AsyncLLM`` (what ``vllm serve`` runs), every data-parallel
    engine asked (``compat.collective_rpc_every_engine``); the engine must be built with ``ROWS_EXTENSION``."""
    extension = engine.vllm_config.parallel_config.worker_extension_cls
    if extension != ROWS_EXTENSION:  # its engines are processes: the rows are reachable only by method name
        raise ValueError(f"request_rows_async needs the engine built with worker_extension_cls={ROWS_EXTENSION!r}, "
                         f"got {extension!r}")  # fmt: skip
    keys = list(keys)
    return merge_rows(await collective_rpc_every_engine(engine, "higgs_request_rows", (keys,)), keys)
