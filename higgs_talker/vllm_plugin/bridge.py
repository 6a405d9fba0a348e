"""Text-only bridge: plain vLLM (no vllm-omni runner) drives the talker through a v1 logits processor.

vLLM's sampler never tells the model whose row is whose; a logits processor hears every batch change
(``update_state``: added with its ``SamplingParams``, removed, moved) before the forward and sees the logits
(``apply``) before sampling, which the bridge turns into the runner's calls. The text token is vLLM's own sample
of logits where only the forced token is finite. A removal may be a finish or a preemption (vLLM does not say):
the slot's state is kept (the last 256) and a request that comes back with generated tokens resumes from it.
Requests are keyed by the ``extra_args`` of ``request_args``; ``request_rows`` reads their rows. Use:
``vllm.LLM(..., logits_processors=[TEXT_ONLY_BRIDGE])``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

from ..heads.slots import merge_rows
from . import ROWS_EXTENSION
from .compat import collective_rpc_every_engine, warn_once
from .talker import talker_for

logger = logging.getLogger(__name__)

REQUEST_KEY = "higgs_request_key"
_PARAMS = ("temperature", "top_k", "top_p")
REFERENCE = "higgs_reference"  # {"rows": delayed reference rows [R, C], "positions": their prompt positions [R]}


def request_args(key: str, prompt=None) -> dict:
    """``SamplingParams.extra_args`` for a bridge request: its key, and a voice-clone ``Prompt``'s reference rows,
    which replace the placeholders' embeddings at prefill as vllm-omni's runner does. Send ``prompt.vllm_prompt()``
    with them: its ``cache_salt`` keeps vLLM's prefix cache from giving one voice another's K/V."""
    args: dict = {REQUEST_KEY: key}
    if prompt is not None and prompt.audio_codes is not None:
        args[REFERENCE] = {"rows": prompt.audio_codes.tolist(), "positions": prompt.audio_positions.tolist()}
    return args


@dataclasses.dataclass(frozen=True)
class _Row:
    key: str
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    min_rows: int  # vLLM's min_tokens: codebook 0 may not end the stream before this many rows
    reference: dict | None  # extra_args[REFERENCE], in the form the adapter substitutes
    resumed: bool  # added with generated tokens: a preempted request come back


class TextOnlyBridge(LogitsProcessor):
    _ids = itertools.count()

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.vllm_config = vllm_config
        self.rows: dict[int, _Row] = {}  # batch index -> request
        self.batch_size, self.armed = 0, False

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """vLLM's per-request check (when a request is added; an HTTP 400 under ``vllm serve``): ValueError naming
        what the bridge cannot honour. Masks on the forced token left garbage text and a request that never ended."""
        problems = []
        if (sampling_params.n or 1) > 1:
            why = f"n={sampling_params.n}: the copies would share the request's key and decode-state slot; send n"
            problems.append(f"{why} requests with distinct extra_args[{REQUEST_KEY!r}] (bridge.request_args) instead")
        if getattr(sampling_params, "structured_outputs", None) or getattr(sampling_params, "guided_decoding", None):
            problems.append("structured outputs: the talker's text token is forced (<|audio|>, then EOS)")
        if sampling_params.allowed_token_ids:
            problems.append("allowed_token_ids: the talker's text token is forced (<|audio|>, then EOS)")
        if problems:
            raise ValueError("the Higgs talker's text-only bridge does not support " + "; ".join(problems))

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the codes of every row, greedy or not

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        model = talker_for(self.vllm_config)
        resume: set[str] = set()  # keys of added requests with generated tokens already: preempted ones come back
        if batch_update is not None:
            before = {id(row): row for row in self.rows.values()}
            process_dict_updates(self.rows, batch_update, lambda params, _, output: self._row(params, output))
            self.batch_size, kept = batch_update.batch_size, {id(row) for row in self.rows.values()}
            # gone: removed, replaced by an added request, or dropped by a one-way move (vLLM 0.26 condenses a live
            # row into a removed one's place and reports that removal only through the move)
            finished = [row.key for i, row in before.items() if i not in kept]
            new = self._unique_keys([row for row in self.rows.values() if id(row) not in before])
            resume = {row.key for row in new if row.resumed}
            if model is not None and finished:
                model.on_requests_removed(finished)
        self.armed = False
        if model is None:
            warn_once("bridge-no-model", "TextOnlyBridge: no talker was built with this vLLM config; no codes")
        if model is None or self.batch_size == 0:
            return
        batch = [self.rows[i] for i in range(self.batch_size)]
        model.slots.keep_finished = max(model.slots.keep_finished, 256)
        seeds = {i: r.seed for i, r in enumerate(batch) if r.seed is not None}
        min_rows = {i: r.min_rows for i, r in enumerate(batch)}
        refs = [r.reference or {} for r in batch]
        model.set_bridge_requests([r.key for r in batch], seeds, min_rows, refs, resume)
        self.armed = True

    def _row(self, params, output: list[int] | None) -> _Row:
        """An added request's row (resumed: it has generated tokens, a preempted request come back)."""
        extra = params.extra_args or {}
        if not extra.get(REQUEST_KEY):
            warn_once("bridge-no-key", "TextOnlyBridge: a request without extra_args[%r] (bridge.request_args): its"
                      " codes are kept under an internal key (vllm-bridge-N)", REQUEST_KEY)  # fmt: skip
        key, ref = str(extra.get(REQUEST_KEY) or f"vllm-bridge-{next(self._ids)}"), extra.get(REFERENCE)
        info = None
        if isinstance(ref, dict):  # in the keys of vllm-omni's info; heads.spans.reference_rows reads both
            info = {"audio_input_ids": ref.get("rows"), "audio_placeholder_positions": ref.get("positions")}
        return _Row(key, float(params.temperature), int(params.top_k), float(params.top_p), params.seed,
                    int(getattr(params, "min_tokens", 0) or 0), info, bool(output))  # fmt: skip

    def _unique_keys(self, new: list[_Row]) -> list[_Row]:
        """Give a request added with a key that another live request holds a unique one (warned): the model keys
        decode-state slots by it, and two requests on one slot corrupt each other's codes. Returns the new rows."""
        fresh, out = {id(r) for r in new}, []
        seen = {r.key for r in self.rows.values() if id(r) not in fresh}
        for index in sorted(self.rows):
            row = self.rows[index]
            if id(row) in fresh:
                if row.key in seen:
                    unique = f"{row.key}#{next(self._ids)}"
                    logger.warning("TextOnlyBridge: request key %r is already live in the batch; this request's "
                                   "codes are kept under %r", row.key, unique)  # fmt: skip
                    row = self.rows[index] = dataclasses.replace(row, key=unique)
                out.append(row)
            seen.add(row.key)
        return out

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        model = talker_for(self.vllm_config)
        if not self.armed or model is None:
            return logits
        self.armed = False
        batch = [self.rows[i] for i in range(self.batch_size)]
        if logits.shape[0] != len(batch):
            return logits
        values = (torch.tensor([getattr(r, n) for r in batch], device=logits.device) for n in _PARAMS)
        model.sample_codes(*values)  # normalized by the frame work (row_params), as the runner path
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
    parallel = llm.llm_engine.vllm_config.parallel_config
    extended = parallel.worker_extension_cls == ROWS_EXTENSION
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
