"""The text-only bridge's requests by vLLM batch index: keys, sampling parameters, seeds and voice-clone rows (host).

Plain vLLM names a request to a logits processor only by its batch index and ``SamplingParams``; the bridge keys
each one by ``extra_args[REQUEST_KEY]`` (``request_args``), and the adapter keys its decode-state slots by that.
A removal may be a finish or a preemption (vLLM does not say); a request added with generated tokens is a
preempted one come back, which resumes its slot. Read duck-typed: importing this imports no vLLM.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

REQUEST_KEY = "higgs_request_key"
REFERENCE = "higgs_reference"  # {"rows": delayed reference rows [R, C], "positions": their prompt positions [R]}
_PARAMS = ("temperature", "top_k", "top_p")
_FORCED = "the talker's text token is forced (<|audio|>, then EOS)"


def request_args(key: str, prompt=None) -> dict:
    """``SamplingParams.extra_args`` for a bridge request: its key, and a voice-clone ``Prompt``'s reference rows,
    which replace the placeholders' embeddings at prefill as vllm-omni's runner does. Send ``prompt.vllm_prompt()``
    with them: its ``cache_salt`` keeps vLLM's prefix cache from giving one voice another's K/V."""
    args: dict = {REQUEST_KEY: key}
    if prompt is not None and prompt.audio_codes is not None:
        args[REFERENCE] = {"rows": prompt.audio_codes.tolist(), "positions": prompt.audio_positions.tolist()}
    return args


def unsupported(params) -> list[str]:
    """What of vLLM's ``SamplingParams`` the bridge cannot honour, one phrase each (none: []). Masks on the forced
    token left garbage text and a request that never ended."""
    problems = []
    if (params.n or 1) > 1:
        why = f"n={params.n}: the copies would share the request's key and decode-state slot; send n"
        problems.append(f"{why} requests with distinct extra_args[{REQUEST_KEY!r}] (bridge.request_args) instead")
    if getattr(params, "structured_outputs", None) or getattr(params, "guided_decoding", None):
        problems.append(f"structured outputs: {_FORCED}")
    if params.allowed_token_ids:
        problems.append(f"allowed_token_ids: {_FORCED}")
    return problems


@dataclasses.dataclass(frozen=True)
class BridgeRequest:
    key: str
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    min_rows: int  # vLLM's min_tokens: codebook 0 may not end the stream before this many rows
    reference: dict | None  # extra_args[REFERENCE], in the keys of vllm-omni's info (heads.spans.reference_rows)
    resumed: bool  # added with generated tokens: a preempted request come back


class BridgeRequests:
    """The live requests by batch index (``by_index``, which vLLM's batch updates edit) and the batch's size."""

    _ids = itertools.count()
    _warned_no_key = False

    def __init__(self) -> None:
        self.by_index: dict[int, BridgeRequest] = {}
        self.size = 0

    def added(self, params, prompt_ids: list[int] | None, generated: list[int] | None) -> BridgeRequest:
        """A request added with vLLM's ``params`` and ``generated`` tokens (any: resumed); vLLM's ``new_state``."""
        extra = params.extra_args or {}
        if not extra.get(REQUEST_KEY) and not BridgeRequests._warned_no_key:
            BridgeRequests._warned_no_key = True
            logger.warning("TextOnlyBridge: a request without extra_args[%r] (bridge.request_args): its codes are"
                           " kept under an internal key (vllm-bridge-N)", REQUEST_KEY)  # fmt: skip
        key, ref = str(extra.get(REQUEST_KEY) or f"vllm-bridge-{next(self._ids)}"), extra.get(REFERENCE)
        info = None
        if isinstance(ref, dict):
            info = {"audio_input_ids": ref.get("rows"), "audio_placeholder_positions": ref.get("positions")}
        return BridgeRequest(key, float(params.temperature), int(params.top_k), float(params.top_p), params.seed,
                             int(getattr(params, "min_tokens", 0) or 0), info, bool(generated))  # fmt: skip

    def update(self, edit: Callable, batch_update) -> tuple[list[str], set[str]]:
        """vLLM's batch update applied by vLLM's ``edit(by_index, batch_update, self.added)``
        (``process_dict_updates``). Returns the keys of the requests gone (removed, replaced by an added one, or
        dropped by a one-way move: vLLM 0.26 condenses a live request into a removed one's place and reports that
        removal only through the move) and of the added ones that resume."""
        before = {id(r): r for r in self.by_index.values()}
        edit(self.by_index, batch_update, self.added)
        self.size, kept = batch_update.batch_size, {id(r) for r in self.by_index.values()}
        new = self._unique_keys([r for r in self.by_index.values() if id(r) not in before])
        return [r.key for i, r in before.items() if i not in kept], {r.key for r in new if r.resumed}

    def _unique_keys(self, new: list[BridgeRequest]) -> list[BridgeRequest]:
        """Give a request added with a key that another live request holds a unique one (warned): the model keys
        decode-state slots by it, and two requests on one slot corrupt each other's codes. Returns the new ones."""
        fresh, out = {id(r) for r in new}, []
        seen = {r.key for r in self.by_index.values() if id(r) not in fresh}
        for index in sorted(self.by_index):
            req = self.by_index[index]
            if id(req) in fresh:
                if req.key in seen:
                    unique = f"{req.key}#{next(self._ids)}"
                    logger.warning("TextOnlyBridge: request key %r is already live in the batch; this request's "
                                   "codes are kept under %r", req.key, unique)  # fmt: skip
                    req = self.by_index[index] = dataclasses.replace(req, key=unique)
                out.append(req)
            seen.add(req.key)
        return out

    def batch(self) -> list[BridgeRequest]:
        """The requests in batch order."""
        return [self.by_index[i] for i in range(self.size)]

    def arguments(self) -> tuple[list[str], dict[int, int], dict[int, int], list[dict]]:
        """The batch as the adapter's ``set_bridge_requests`` takes it: keys, seeds and min rows by batch index
        (seeded requests only), voice-clone infos."""
        batch = self.batch()
        seeds = {i: r.seed for i, r in enumerate(batch) if r.seed is not None}
        min_rows = {i: r.min_rows for i, r in enumerate(batch)}
        return [r.key for r in batch], seeds, min_rows, [r.reference or {} for r in batch]

    def params(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p) [B] of the batch, as vLLM's sampling metadata has them."""
        batch = self.batch()
        return tuple(torch.tensor([getattr(r, n) for r in batch], device=device) for n in _PARAMS)
