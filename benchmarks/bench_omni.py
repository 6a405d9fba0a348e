"""The talker inside vllm-omni's own two-stage pipeline (Stage 0 talker -> Stage 1 code2wav): ours against
vllm-omni's in-tree talker, per deploy profile and concurrency, offline and over HTTP, with our direct engine
beside them. Runs on a GPU (H200 runs: ``results/h200_2026120*``); on a CPU-only machine vllm-omni's ``Omni``
does not import (its pipeline registry pulls in torchvision, whose PyPI wheels need CUDA torch), and only
``--help``, the checkpoint writer, a run with its budget spent (every configuration recorded as skipped) and the
direct path (our engine needs no vLLM; ``--smoke --paths direct`` runs in under a minute) work.

Talkers: ``ours`` (this project's plugin installed: vllm-omni's Higgs architectures resolve to our talker) with
our packaged profiles (``higgs_talker/vllm_plugin/deploy``); ``upstream`` (``VLLM_PLUGINS=vllm_omni_register_models``
in its processes, so only vllm-omni's own plugin loads) with vllm-omni's own YAMLs. Profiles: ``low_latency``,
``high_throughput`` (each talker's packaged YAML of that name), ``vllm_omni_low_latency`` (vllm-omni's low-latency
YAML: each talker's high-throughput YAML, which has vllm-omni's shape in both, with its FULL decode graphs up to 16
streams; our packaged low-latency profile had this shape until 2026-12-07), and those derived from it (``DERIVED``):
``full_decode_64`` (FULL decode graphs up to 64 streams), ``full_decode_64_no_prefix_cache`` (the same, prefix
caching off), ``low_latency_async`` (vLLM's async scheduling asked for), ``low_latency_frame_graphs`` (our frame
graphs asked for in Stage 0's ``hf_overrides``; vllm-omni's talker ignores the key),
``high_throughput_frame_graphs`` (the same on the high-throughput YAML), ``full_decode_64_frame_graphs`` (both) and
``low_latency_async_frame_graphs`` (async scheduling, frame graphs and our Stage 0 -> code2wav hand-over,
``HAND_OVER``), ``full_decode_64_async`` and ``full_decode_64_async_frame_graphs``, and the last two on vLLM's
FlashAttention backend instead of FlashInfer (``..._flash_attn``); ``..._our_stage1``: the same with our Stage 1
(``higgs_talker.vllm_plugin.code2wav``: vllm-omni's code2wav decoding a step's chunks of one length as one batch,
each chunk with the codec's reach of left context instead of 25 frames: ``OUR_STAGE1``); ``..._reach_context``: the
left context alone, for either talker. ``full_decode_64_async_frame_graphs_our_stage1`` is the packaged
``full-decode`` profile (and the default), ``low_latency_async_frame_graphs_our_stage1`` the packaged
``low-latency`` one. vllm-omni's talker, asked for a profile with our frame graphs or our Stage 1, runs the one
without them, with its own hand-over and Stage 1 (``UPSTREAM_SAME``), so one run compares each of ours with
vllm-omni's nearest. Each (talker, profile, path) runs in its own process (a fresh CUDA context; ``Omni`` and
``vllm-omni serve`` start their own stage processes), on one checkpoint: ``omni_checkpoint.py``'s (4B shape, random
bf16 weights, EOC suppressed, the real-layout random codec). Lengths are forced (``max_tokens = min_tokens`` = the
rows of ``--audio-s`` seconds), sampling is the profiles' (temperature 1.0, top_p 0.95, top_k 50), seeded.

Paths (the ``path`` of a row):
- ``offline``: ``vllm_omni.Omni(model, deploy_config).generate`` with C prompts at a time (the offline API takes
  a batch; waves of C over ``level_requests(C)`` = max(2C, 16) requests), outputs read as they come
  (``py_generator``) with Stage 1 asked for deltas: ``ttfa`` is submit -> the request's first audio, or its finish
  where the offline API did not stream (the row's ``offline_streamed`` says which);
- ``http``: ``vllm-omni serve`` on a free port, a closed loop of C clients (httpx, ``stream_format: audio``, PCM);
  ``ttfa`` is sent -> first audio byte;
- ``direct``: our engine (``HiggsTalker.stream_audio`` with vllm-omni's chunking, C threads, the same sampling,
  seeded), once.

Each path warms up first, untimed: offline and HTTP with one wave of 2 s requests at every level (C requests
together: vLLM's sampler compiles Triton kernels per batch shape; in h100_20261206 vllm-omni's talker compiled its
top-k/top-p kernel 5 s after its start, past the one warm-up wave of two), direct with one short request per stream.
Per level: TTFA and RTF (wall / audio seconds) p50/p90, audio seconds per wall second. A worker that has reported
its levels and is still shutting down ``SHUTDOWN_S`` later is stopped (its stage processes with it) and counts as
done: shutdown is not measured and does not use the next configuration's share of ``--budget-s``.

    python benchmarks/bench_omni.py --out $OUT                       # both talkers x profiles x paths, 1,4,16,64
    python benchmarks/bench_omni.py --smoke --out $OUT               # small shape, levels 1,2, 1 s of audio
    python benchmarks/bench_omni.py --smoke --paths direct --talkers ours   # the direct path alone, CPU too
    python benchmarks/bench_omni.py --talkers ours --profiles low_latency --paths offline --levels 1,16
    python benchmarks/bench_omni.py --profiles low_latency --paths offline --budget-s 480 --out $OUT  # one call
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import operator
import os
import random
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from higgs_talker.codec.streaming import UPSTREAM_CHUNKING, window_lengths
from higgs_talker.row_linear_op import ASK_KEY as ROW_LINEARS_KEY
from higgs_talker.vllm_plugin import CODEC_ARCH, CODEC_GRAPH_FRAMES
from higgs_talker.vllm_plugin.deploy import RAMP_KEY

TALKERS = ("ours", "upstream")
PROFILES = (
    "low_latency",
    "high_throughput",
    "vllm_omni_low_latency",
    "full_decode_64",
    "full_decode_64_no_prefix_cache",
    "low_latency_async",
    "low_latency_frame_graphs",
    "high_throughput_frame_graphs",
    "full_decode_64_frame_graphs",
    "low_latency_async_frame_graphs",
    "full_decode_64_async",
    "full_decode_64_async_frame_graphs",
    "full_decode_64_async_flash_attn",
    "full_decode_64_async_frame_graphs_flash_attn",
    "full_decode_64_async_no_prefix_cache",
    "full_decode_64_async_frame_graphs_no_prefix_cache",
    "full_decode_64_async_mp",
    "full_decode_64_async_frame_graphs_mp",
    "full_decode_64_async_our_stage1",
    "full_decode_64_async_frame_graphs_our_stage1",
    "full_decode_64_async_reach_context",
    "full_decode_64_async_frame_graphs_reach_context",
    "full_decode_64_async_frame_graphs_our_stage1_ramp",
    "full_decode_64_async_frame_graphs_no_prefix_cache_our_stage1",
    "full_decode_64_async_frame_graphs_mp_our_stage1",
    "low_latency_async_frame_graphs_our_stage1",
    "full_decode_64_async_frame_graphs_our_stage1_row_linears",
)
# a profile named ..._our_stage1 is its base profile with our Stage 1 (vllm-omni 0.26 decodes each request's chunk
# alone, and at 64 streams both talkers ended near the same audio s/s: h200_20261205b): a step's chunks of one length
# decoded as one batch, and each chunk's left context cut from vllm-omni's 25 frames to the codec's reach, 10 (the
# most frames before a frame whose codes change its samples: codec.model.decoder_reach), which gives the same audio
# (tests/vllm_plugin/test_omni_checkpoint.py) from 39 decoded frames a chunk instead of 54. ..._reach_context: the
# left context alone (a plain YAML setting, so vllm-omni's talker runs it too), which tells the two apart.
CONNECTORS = "connectors"  # derived_yaml: keys of every connector's extra
CODEC_REACH = 10
REACH_CONTEXT = {CONNECTORS: {"codec_left_context_frames": CODEC_REACH}}
# our Stage 1 also decodes the windows of the profiles' chunking (vllm-omni's, with that left context) in CUDA graphs
STAGE1_RULE = dataclasses.replace(UPSTREAM_CHUNKING, left_context_frames=CODEC_REACH)
STAGE1_WINDOWS = window_lengths(STAGE1_RULE)
OUR_STAGE1 = REACH_CONTEXT | {1: {"model_arch": CODEC_ARCH, "hf_overrides": {CODEC_GRAPH_FRAMES: STAGE1_WINDOWS}}}
STAGE1_VARIANTS = {"_our_stage1": OUR_STAGE1, "_reach_context": REACH_CONTEXT}  # profile suffix -> what it adds
# ..._ramp: our hand-over's ramped chunks (deploy.RAMP_KEY: each chunk as long as the frames sent before it), and our
# Stage 1's graphs for the ramp's windows too
RAMPED_WINDOWS = window_lengths(dataclasses.replace(STAGE1_RULE, ramp=True))
RAMP = {CONNECTORS: {RAMP_KEY: True}, 1: {"hf_overrides": {CODEC_GRAPH_FRAMES: RAMPED_WINDOWS}}}
# Profiles measured beside the two packaged ones (issue #28): each talker's low-latency YAML (vLLM's FULL decode
# graphs) with 64 streams and graphs up to 64, prefix caching as it is or off; and with vLLM's async scheduling
# asked for (vLLM turns it off, with a warning, where the stage's scheduler cannot do it); and with our frame graphs
# (cuda_graphs.frame, asked for through the model config; vllm-omni's talker ignores the key)
FULL_64 = {
    "max_num_seqs": 64,
    "compilation_config": {
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_num_of_warmups": 1,
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24, 32, 48, 64],
    },
}
FRAME_GRAPHS = {"hf_overrides": {"higgs_frame_graphs": True}}
ASYNC = {"async_scheduling": True}
# vLLM's FlashAttention backend instead of the YAMLs' FlashInfer: on the H200 FlashInfer ran its prefill kernel for
# the one-row decode (0.37 ms of a 3.5 ms step) and plans on the host every step (h200_20261204e)
FLASH_ATTN = {"attention_backend": "FLASH_ATTN", "attention_config": None}
# Stage 0's host work per step outside our entry points (10.8 ms of a 14.9 ms step at 64 streams, h200_20261204e):
# vllm-omni 0.26 drains a tensor prefix cache every step where prefix caching is on, and runs the scheduler, the
# runner and its hand-over thread in one process (one GIL); vLLM's multiprocess executor puts the runner in a
# process of its own (read in the sources, not yet measured)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}
MP = {"distributed_executor_backend": "mp"}
# our Stage 0 -> code2wav hand-over: vllm-omni's, told the finished flag a call was queued with (vllm-omni's own
# doubles an EOS-ended request's audio under async scheduling: higgs_talker.vllm_plugin.deploy)
HAND_OVER = {"custom_process_next_stage_input_func": "higgs_talker.vllm_plugin.deploy.talker2code2wav_async_chunk"}
ASYNC_FRAME_GRAPHS = ASYNC | FRAME_GRAPHS | HAND_OVER  # frame graphs under async scheduling: with our hand-over


def _plus(derived: tuple[str, dict], more: dict) -> tuple[str, dict]:
    """A derived profile (base YAML, overrides) with ``more`` overrides merged in, section by section."""
    base, overrides = derived
    return base, overrides | {k: overrides.get(k, {}) | v for k, v in more.items()}


# vllm-omni's low-latency YAML is its high-throughput one with these on Stage 0 (vllm-omni 0.26-0.30; for vllm-omni's
# talker the derived YAML loads equal to its own: tests/vllm_plugin/test_omni_checkpoint.py)
LOW_LATENCY_SHAPE = {
    "max_num_seqs": 16,
    "enforce_eager": False,
    "compilation_config": {
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16],
        "cudagraph_num_of_warmups": 1,
    },
}
LOW_LATENCY_BASE = "vllm_omni_low_latency"  # the base of the low_latency_* and full_decode_64* profiles


def _full_64(*stage0: dict) -> tuple[str, dict]:
    """vllm-omni's low-latency YAML with 64 streams and FULL decode graphs up to 64 (``FULL_64``; Stage 1 takes 64
    too), and ``stage0``'s keys on Stage 0."""
    return LOW_LATENCY_BASE, {0: functools.reduce(operator.or_, stage0, FULL_64), 1: {"max_num_seqs": 64}}


DERIVED = {LOW_LATENCY_BASE: ("high_throughput", {0: LOW_LATENCY_SHAPE}),
           "full_decode_64": _full_64(),
           "full_decode_64_no_prefix_cache": _full_64(NO_PREFIX_CACHE),
           "low_latency_async": (LOW_LATENCY_BASE, {0: ASYNC}),
           "low_latency_frame_graphs": (LOW_LATENCY_BASE, {0: FRAME_GRAPHS}),
           # the eager profile, whose step is host time, with the frame work replayed from graphs
           "high_throughput_frame_graphs": ("high_throughput", {0: FRAME_GRAPHS}),
           "full_decode_64_frame_graphs": _full_64(FRAME_GRAPHS),
           "low_latency_async_frame_graphs": (LOW_LATENCY_BASE, {0: ASYNC_FRAME_GRAPHS}),
           "full_decode_64_async": _full_64(ASYNC),
           "full_decode_64_async_frame_graphs": _full_64(ASYNC_FRAME_GRAPHS),
           "full_decode_64_async_flash_attn": _full_64(ASYNC, FLASH_ATTN),
           "full_decode_64_async_frame_graphs_flash_attn": _full_64(ASYNC_FRAME_GRAPHS, FLASH_ATTN),
           "full_decode_64_async_no_prefix_cache": _full_64(ASYNC, NO_PREFIX_CACHE),
           "full_decode_64_async_frame_graphs_no_prefix_cache": _full_64(ASYNC_FRAME_GRAPHS, NO_PREFIX_CACHE),
           "full_decode_64_async_mp": _full_64(ASYNC, MP),
           "full_decode_64_async_frame_graphs_mp": _full_64(ASYNC_FRAME_GRAPHS, MP)}  # fmt: skip
DERIVED |= {p: _plus(DERIVED[p.removesuffix(suffix)], more) for p in PROFILES
            for suffix, more in STAGE1_VARIANTS.items() if p.endswith(suffix)}  # fmt: skip
# ..._row_linears: Stage 0's linears through our one-row and few-row Triton kernels where they measure faster than
# vLLM's GEMM (higgs_talker.row_linear_op; hf_overrides replaces the section, so the frame graphs' key comes along)
OUR_ROW_LINEARS = {0: {"hf_overrides": FRAME_GRAPHS["hf_overrides"] | {ROW_LINEARS_KEY: True}}}
LATE_VARIANTS = {"_ramp": RAMP, "_row_linears": OUR_ROW_LINEARS}  # suffix on a derived profile -> what it adds
DERIVED |= {p: _plus(DERIVED[p.removesuffix(suffix)], more) for p in PROFILES
            for suffix, more in LATE_VARIANTS.items() if p.endswith(suffix)}  # fmt: skip
# vllm-omni's talker ignores higgs_frame_graphs and higgs_row_linears, runs with its own hand-over, and (our plugin not
# loaded) its own Stage 1: asked for a profile with our frame graphs, row linears or Stage 1, it runs the same profile
# without them (listed under that name; once where several are asked for)
OURS_ONLY = ("_row_linears", "_ramp", "_our_stage1")  # suffixes it drops, outermost first


def without_ours_only(profile: str) -> str:
    """``profile`` without its ``OURS_ONLY`` suffixes: the profile they were added to."""
    for suffix in OURS_ONLY:
        profile = profile.removesuffix(suffix)
    return profile


UPSTREAM_SAME = {p: without_ours_only(p.replace("_frame_graphs", "")) for p in PROFILES
                 if "_frame_graphs" in p or p.endswith(OURS_ONLY)}  # fmt: skip
PATHS = ("offline", "http", "direct")
LEVELS = (1, 4, 16, 64)
LEVELS_DONE = "LEVELS DONE"  # a worker's last line of results: what follows is its shutdown
SHUTDOWN_S = 30  # how long a worker whose levels are done may take to shut down before it is stopped
SERVER_GROUP = "SERVER GROUP "  # a worker's line naming the process group of the server it started
SAMPLE_RATE = 24000
FRAME_RATE = 25
NUM_CODEBOOKS = 8
WARM_ROWS = 2 * FRAME_RATE + NUM_CODEBOOKS  # a warm-up request: 2 s of audio
WARM_SEED = 500_000  # warm-up prompts and seeds apart from the timed ones (a shared prompt would hit the prefix cache)
UPSTREAM_YAML = {"low_latency": "higgs_multimodal_qwen3_low_latency.yaml",
                 "high_throughput": "higgs_multimodal_qwen3_high_throughput.yaml"}  # fmt: skip
UPSTREAM_ONLY = {"VLLM_PLUGINS": "vllm_omni_register_models"}  # vllm-omni's plugin alone: its in-tree talker


# ---------------------------------------------------------------------------------------------------------
# shared with tests/vllm_plugin/omni_run.py (nothing here imports vLLM at module level)


def deploy_yaml(talker: str, profile: str) -> Path:
    """The deploy YAML of ``talker`` (ours: the packaged profile; upstream: vllm-omni's own) and ``profile``."""
    if talker == "ours":
        from higgs_talker.vllm_plugin.deploy import deploy_config_path

        return deploy_config_path(profile)
    if talker == "upstream":
        import vllm_omni

        return Path(vllm_omni.__file__).parent / "deploy" / UPSTREAM_YAML[profile]
    raise ValueError(f"unknown talker {talker!r}; choose from {TALKERS}")


# stage keys whose mappings vllm-omni merges key by key when a YAML overrides its base_config (others: replaced whole)
_MERGED_STAGE_KEYS = frozenset(("default_sampling_params", "subtalker_sampling_params", "engine_extras", "engine_args"))
# what vllm-omni 0.26 and 0.30 read differently in a YAML with a base_config (0.30 merges them key by key)
_VERSION_DEPENDENT = {"top level": frozenset(("connectors",)), "stage": frozenset(("default_pooling_params",))}


def read_profile(path: str | Path) -> dict:
    """A deploy YAML as vllm-omni reads it: where it names a ``base_config`` (a path relative to it), that file is read
    first (the same way), this one's top-level keys replace the base's, and its ``stages`` override the base's stage
    for stage (by ``stage_id``) key for key; a stage it adds is appended. Refused: ``platforms`` blocks (not applied
    here), and in a file with a base_config the keys that vllm-omni's versions merge differently (``connectors``)."""
    import yaml

    path = Path(path)
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a deploy YAML (a mapping at its top level)")
    if "platforms" in data:
        raise ValueError(f"{path} has a platforms block: read_profile does not apply those")
    base_name = data.pop("base_config", None)
    if base_name is None:
        return data
    stage_keys = {key for stage in data.get("stages") or [] for key in stage}
    for where, keys in (("top level", data.keys()), ("stage", stage_keys)):
        if clash := sorted(_VERSION_DEPENDENT[where] & keys):
            raise ValueError(f"{path} sets {clash} at {where} over its base_config: vllm-omni 0.26 replaces them "
                             "whole, later versions merge them key by key; write the file whole instead")  # fmt: skip
    base = read_profile(path.parent / base_name)
    stages = {stage["stage_id"]: stage for stage in base.get("stages") or []}
    for stage in data.pop("stages", None) or []:
        stages[stage["stage_id"]] = _override(stages.get(stage["stage_id"], {}), stage)
    return base | data | {"stages": list(stages.values())}


def stage_of(path: str | Path, stage_id: int) -> dict:
    """Stage ``stage_id`` of a deploy YAML, read by ``read_profile``."""
    (stage,) = (s for s in read_profile(path)["stages"] if s["stage_id"] == stage_id)
    return stage


def _override(base: dict, overlay: dict) -> dict:
    """A stage of a base_config overridden by a stage of the same id (``read_profile``)."""
    merged = base | overlay
    for key in _MERGED_STAGE_KEYS & base.keys() & overlay.keys():
        merged[key] = _merge_nested(base[key], overlay[key])
    return merged


def _merge_nested(base, overlay):
    if not (isinstance(base, dict) and isinstance(overlay, dict)):
        return overlay
    return base | {key: _merge_nested(base.get(key), value) for key, value in overlay.items()}


def profile_yaml(talker: str, profile: str, out_dir: Path) -> Path:
    """The YAML ``talker`` runs ``profile`` with: a packaged one (``deploy_yaml``), or one of ``DERIVED`` (from its
    base, packaged or derived itself) written to ``out_dir``."""
    if profile not in DERIVED:
        return deploy_yaml(talker, profile)
    base, overrides = DERIVED[profile]
    return derived_yaml(profile_yaml(talker, base, out_dir), Path(out_dir) / f"{talker}_{profile}.yaml", overrides)


def upstream_profile(profile: str) -> str:
    """The profile vllm-omni's talker runs when asked for ``profile`` (``UPSTREAM_SAME``)."""
    return UPSTREAM_SAME.get(profile, profile)


STAGE_FIELDS = ("s0_first_row_ms_p50", "s0_step_ms_p50", "s0_step_ms_p90", "s1_first_audio_ms_p50",
                "s1_chunk_gap_ms_p50", "e2e_ms_p50", "s1_over_length")  # fmt: skip


def with_stage_stats(rows: list[dict], server_log: Path) -> list[dict]:
    """An HTTP worker's rows with what its server logged per request, per level (``omni_stage_stats``: Stage 0's
    time to its first row and per step, Stage 1's to its first audio and between chunks, requests whose audio went
    out twice); the rows as they are, with a line on stderr, where the log does not give them."""
    from common import log
    from omni_stage_stats import summarize

    try:
        stats = summarize({"rows": rows}, {server_log.name: server_log.read_text(errors="replace")})
    except (OSError, ValueError) as exc:
        log(f"no stage figures from {server_log.name}: {exc}")
        return rows
    by_level = {s["concurrency"]: s for s in stats}
    return [row | {f: by_level[row["concurrency"]][f] for f in STAGE_FIELDS} if row.get("concurrency") in by_level
            else row for row in rows]  # fmt: skip


def talker_configs(talker: str, path: str, profiles: list[str], upstream: list[str] | None) -> list[tuple]:
    """(talker, profile, path) of each profile ``talker`` runs on ``path``: ours ``profiles``; vllm-omni's talker
    ``upstream`` where given, else each of ``profiles`` as it runs it (``upstream_profile``)."""
    if talker != "upstream":
        return [(talker, profile, path) for profile in profiles]
    return [(talker, profile, path) for profile in (upstream or [upstream_profile(p) for p in profiles])]


def talker_env(talker: str) -> dict[str, str]:
    """The environment a process of ``talker`` runs in (upstream: only vllm-omni's plugin loads)."""
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # its JIT takes minutes on a fresh machine
    if talker == "upstream":
        env |= UPSTREAM_ONLY
    return env


def jit_verbose_yaml(base: Path, out: Path) -> Path:
    """``base`` with Stage 0's ``jit_monitor_verbose`` on (vLLM 0.26+: every Triton kernel compiled after warm-up is
    logged with its specialization key, where the default logs the first one's name once)."""
    return derived_yaml(base, out, {0: {"jit_monitor_verbose": True}})


def derived_yaml(base: Path, out: Path, stage_overrides: dict) -> Path:
    """``base`` with keys of stages replaced (``{stage_id: {key: value}}``; value None drops the key; the key
    ``CONNECTORS`` replaces keys of every connector's ``extra``), at ``out``, written whole: a ``base_config`` the YAML
    names is merged in as vllm-omni merges it (``read_profile``)."""
    import yaml

    data = read_profile(base)
    sections = [(stage, stage_overrides.get(stage["stage_id"], {})) for stage in data["stages"]]
    connectors = list((data.get("connectors") or {}).values())
    if stage_overrides.get(CONNECTORS) and not connectors:
        raise ValueError(f"{base} has no connectors to set {sorted(stage_overrides[CONNECTORS])} on")
    sections += [(c.setdefault("extra", {}), stage_overrides.get(CONNECTORS, {})) for c in connectors]
    for section, overrides in sections:
        for key, value in overrides.items():
            if value is None:
                section.pop(key, None)
            else:
                section[key] = value
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def stage_params(omni, temperature: float | None, seed: int | None, rows: int | None, stream: bool) -> list:
    """Per-stage sampling parameters: the deploy defaults with Stage 0's ``temperature`` (None: the profile's),
    ``seed`` and forced length ``rows`` (None: the profile's cap) set, and Stage 1 asked for deltas (``stream``)."""
    from vllm.sampling_params import RequestOutputKind

    defaults = getattr(omni, "default_sampling_params_list", None)
    if not defaults:
        raise RuntimeError("this vllm-omni's Omni has no default_sampling_params_list; pass the stages' params")
    s0, s1 = (p.clone() if hasattr(p, "clone") else p for p in defaults[:2])
    if temperature is not None:
        s0.temperature = temperature
    s0.seed = seed
    if rows is not None:
        s0.max_tokens = s0.min_tokens = rows
    if stream and hasattr(s1, "output_kind"):
        s1.output_kind = RequestOutputKind.DELTA
    return [s0, s1, *defaults[2:]]


def audio_of(output) -> Any:
    """The float32 waveform [S] (CPU tensor) an Omni output carries, or None: ``multimodal_output`` of the output
    or of its completions, key ``audio`` or ``model_outputs``, a tensor or a list of chunks."""
    import torch

    mm = getattr(output, "multimodal_output", None)
    for completion in [] if mm else getattr(output, "outputs", None) or []:
        mm = getattr(completion, "multimodal_output", None)
        if mm:
            break
    if not mm:
        return None
    value = mm.get("audio", mm.get("model_outputs"))
    parts = value if isinstance(value, list | tuple) else [value]
    parts = [torch.as_tensor(p).detach().float().reshape(-1).cpu() for p in parts if p is not None]
    return torch.cat(parts) if parts else None


def offline_streams() -> bool:
    """Whether this vllm-omni's offline ``generate`` can hand outputs over as they come: its ``py_generator``
    closes the whole ``Omni`` once the generator ends in 0.26 (``_run_generation_with_generator``), and 0.30 no
    longer does; versions in between are not known here, so below 0.30 the list API runs (outputs only at the end:
    no first-chunk times)."""
    from importlib.metadata import version

    return tuple(int(x) for x in version("vllm-omni").split(".")[:2] if x.isdigit()) >= (0, 30)


def offline_outputs(omni, prompts: list, params: list, streams: bool):
    """The outputs of one offline ``generate``: as they come where ``streams`` (``offline_streams()``), else the
    list."""
    if streams:
        return omni.generate(prompts, params, py_generator=True, use_tqdm=False)
    return omni.generate(prompts, params, use_tqdm=False)


def prompt_ids(ckpt: str, text: str) -> list[int]:
    """Our prompt for ``text`` (equal to vllm-omni's ``HiggsAudioV3TokenizerAdapter.build_prompt``; checked on CPU
    by tests/vllm_plugin/test_omni_checkpoint.py)."""
    return checkpoint_tokenizer(ckpt)[1].build(text).input_ids.tolist()


@functools.lru_cache(maxsize=4)
def checkpoint_tokenizer(ckpt: str):
    """(config, tokenizer) of a checkpoint, loaded once (a 4B checkpoint's tokenizer takes a while)."""
    from higgs_talker.config import TalkerConfig
    from higgs_talker.prompt import TalkerTokenizer

    cfg = TalkerConfig.from_pretrained(ckpt)
    return cfg, TalkerTokenizer.from_pretrained(ckpt, cfg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: str, yaml_path: Path, env: dict[str, str], log_path: Path, timeout: float = 900):
    """``vllm-omni serve`` on a free port (its own process group) -> (process, base URL) once /health answers 200."""
    import httpx

    port = free_port()
    # the console script's module, run by this interpreter: an install with --target puts no script on PATH
    cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", ckpt, "--omni", "--deploy-config",
           str(yaml_path), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    sink = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    print(f"{SERVER_GROUP}{proc.pid}", flush=True)  # for the parent, should it have to stop this worker
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sink.close()
            raise RuntimeError(f"vllm-omni serve exited with {proc.returncode}; the end of {log_path}:\n"
                               + log_tail(log_path))  # fmt: skip
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop_server(proc)
    raise TimeoutError(f"vllm-omni serve did not answer /health in {timeout} s; see {log_path}")


def log_tail(path: Path, lines: int = 12) -> str:
    """The last lines of a log that are not vLLM's INFO / DEBUG chatter (a failed start's cause, usually)."""
    kept = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines()
            if " INFO " not in ln and " DEBUG " not in ln]  # fmt: skip
    return "\n".join(kept[-lines:])


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside, SIGTERM (what ``timeout`` and process supervisors send) raises KeyboardInterrupt, so that the
    ``finally`` blocks and fixture teardowns that stop servers and workers still run: those run in sessions of their
    own and outlive a process killed outright (on the H100, 2026-12-07, a pytest stopped by ``timeout`` left its
    ``vllm-omni serve`` running). Outside the main thread, where no handler can be set, it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_server(proc) -> None:
    """SIGTERM to the server's process group (it spawned its stage processes), SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


# ---------------------------------------------------------------------------------------------------------
# measuring


def level_requests(level: int) -> int:
    """Requests timed at concurrency ``level``: two waves, and at least 16 (8 gave p90s of one or two requests)."""
    return max(2 * level, 16)


def jobs(n: int, seed: int) -> list[dict]:
    """n requests: random words (30-200 characters), each with its own seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        chars, words = rng.randint(30, 200), []
        while sum(len(w) + 1 for w in words) < chars:
            words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))))
        out.append({"text": " ".join(words) + ".", "seed": seed + i})
    return out


def level_row(base: dict, level: int, records: list[dict], wall: float, most_s: float) -> dict:
    """A level's row from its requests' records. ``most_s``: the most audio a request's rows can decode to (its
    frames at 25 a second). A request that returns more (vllm-omni's own hand-over under async scheduling sent 108 of
    192 requests' audio twice, ``results/h100_20261206b``) counts ``most_s`` of it towards the throughput and its
    RTF, and is counted in ``over_length``; ``audio_s_max`` and ``audio_s_per_s_received`` show what came."""
    from common import percentile

    counted = [min(r["audio_s"], most_s) for r in records]
    # an RTF is wall / audio: over the audio counted, a request's RTF grows by what it sent beyond it
    records = [r | {"rtf": r["rtf"] * r["audio_s"] / c} if r.get("rtf") is not None and c else r
               for r, c in zip(records, counted, strict=True)]  # fmt: skip
    row = base | {"concurrency": level, "requests": len(records), "wall_s": wall,
                  "audio_s_per_s": sum(counted) / wall if wall else None,
                  "audio_s_per_s_received": sum(r["audio_s"] for r in records) / wall if wall else None}  # fmt: skip
    for m in ("ttfa_ms", "rtf", "stall_ms"):  # stall_ms: streamed paths only (a player's waits after the first byte)
        if any(r.get(m) is not None for r in records):
            for q in (50, 90):
                row[f"{m}_p{q}"] = percentile([r[m] for r in records if r.get(m) is not None], q)
    row["audio_s_min"] = min((r["audio_s"] for r in records), default=None)
    row["audio_s_max"] = max((r["audio_s"] for r in records), default=None)
    row["over_length"] = sum(r["audio_s"] > most_s for r in records)
    row["status"] = "ok"
    return row


def _offline_wave(omni, wave: list[dict], rows: int, streams: bool) -> tuple[list[dict], bool]:
    """One wave of requests through ``omni`` together: a record per request, and whether audio came in pieces."""
    params = stage_params(omni, None, wave[0]["seed"], rows, stream=True)
    sent, first, audio, done, streamed = time.perf_counter(), {}, {}, {}, False
    for out in offline_outputs(omni, [j["prompt"] for j in wave], params, streams):
        now, rid, wav = time.perf_counter(), out.request_id, audio_of(out)
        if wav is not None and wav.numel():
            streamed |= streams and rid in first
            first.setdefault(rid, now)
            audio[rid] = audio.get(rid, 0) + wav.numel()
        if getattr(out, "finished", True):
            done[rid] = now
    records = []
    for rid, end in done.items():
        seconds = audio.get(rid, 0) / SAMPLE_RATE
        records.append({"ttfa_ms": (first.get(rid, end) - sent) * 1e3, "audio_s": seconds,
                        "rtf": (end - sent) / seconds if seconds else None})  # fmt: skip
    return records, streamed


def run_offline(args: argparse.Namespace, base: dict) -> None:
    from vllm_omni import Omni

    t0 = time.perf_counter()
    omni = Omni(model=args.model, deploy_config=str(args.yaml), stage_init_timeout=args.worker_timeout)
    base = base | {"start_s": time.perf_counter() - t0}
    rows_out, rows, streams = [], args.frames + NUM_CODEBOOKS, offline_streams()
    most_s = args.frames / FRAME_RATE

    def tokenized(todo: list[dict]) -> list[dict]:
        return [j | {"prompt": {"prompt_token_ids": prompt_ids(args.model, j["text"])}} for j in todo]

    try:
        for level in args.levels:  # warm up: one short wave of each level's size
            _offline_wave(omni, tokenized(jobs(level, args.seed + WARM_SEED + 1000 * level)), WARM_ROWS, streams)
        for level in args.levels:
            todo, records, streamed = tokenized(jobs(level_requests(level), args.seed + 1000 * level)), [], False
            wall0 = time.perf_counter()
            for start in range(0, len(todo), level):
                got, pieces = _offline_wave(omni, todo[start : start + level], rows, streams)
                records += got
                streamed |= pieces
            wall = time.perf_counter() - wall0
            rows_out.append(level_row(base | {"offline_streamed": streamed}, level, records, wall, most_s))
            print("RESULT:" + json.dumps(rows_out), flush=True)
        print(LEVELS_DONE, flush=True)
    finally:
        omni.close()


async def _http_level(url: str, todo: list[dict], level: int, rows: int) -> tuple[list[dict], float]:
    import asyncio

    import httpx
    from http_load import stream_speech

    queue, records = list(todo), []
    limits = httpx.Limits(max_connections=level + 4, max_keepalive_connections=level + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def worker() -> None:
            while queue:
                job = queue.pop(0)
                # stream_format "audio": raw PCM (vllm-omni 0.26-0.30 answer a bare "stream": true with SSE events)
                body = {"input": job["text"], "response_format": "pcm", "stream": True, "stream_format": "audio",
                        "seed": job["seed"], "max_new_tokens": rows}  # fmt: skip
                t0, first, end, size, stall = await stream_speech(client, body, bytes_per_second=2 * SAMPLE_RATE)
                seconds = size / 2 / SAMPLE_RATE
                records.append({"ttfa_ms": (first - t0) * 1e3 if first else None, "audio_s": seconds,
                                "rtf": (end - t0) / seconds if seconds else None, "stall_ms": stall * 1e3})  # fmt: skip

        wall0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(level, len(todo)))))
    return records, time.perf_counter() - wall0


def run_http(args: argparse.Namespace, base: dict) -> None:
    import asyncio

    t0 = time.perf_counter()
    log_path = Path(args.out_dir) / f"server_{base['talker']}_{base['profile']}.log"
    proc, url = start_server(args.model, Path(args.yaml), talker_env(base["talker"]), log_path,
                             args.worker_timeout)  # fmt: skip
    base = base | {"start_s": time.perf_counter() - t0}
    rows_out = []
    try:
        for level in args.levels:  # warm up: one short wave of each level's size
            asyncio.run(_http_level(url, jobs(level, args.seed + WARM_SEED + 1000 * level), level, WARM_ROWS))
        for level in args.levels:
            records, wall = asyncio.run(_http_level(url, jobs(level_requests(level), args.seed + 1000 * level), level,
                                                    args.frames + NUM_CODEBOOKS))  # fmt: skip
            rows_out.append(level_row(base, level, records, wall, args.frames / FRAME_RATE))
            print("RESULT:" + json.dumps(rows_out), flush=True)
        print(LEVELS_DONE, flush=True)
    finally:
        stop_server(proc)


def run_direct(args: argparse.Namespace, base: dict) -> None:
    """Our engine alone: bench_serve's closed loop of C threads over ``stream_audio`` with vllm-omni's chunking."""
    import torch
    from bench_serve import run_direct as closed_loop
    from common import SAMPLINGS

    from higgs_talker import HiggsTalker
    from higgs_talker.codec import UPSTREAM_CHUNKING

    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the smoke run of this path (tests)
    talker = HiggsTalker.from_pretrained(args.model, device=device, dtype="bfloat16", max_num_seqs=max(args.levels))
    talker.codec  # noqa: B018 - load the decoder before timing
    base = base | {"start_s": time.perf_counter() - t0}
    deploy = {"sampling": dict(SAMPLINGS["deploy"])}  # the profiles' sampling, as the offline and HTTP paths use
    warm = [{"text": "warm up.", "frames": 30, "seed": i} | deploy for i in range(max(args.levels))]
    closed_loop(talker, warm, max(args.levels), UPSTREAM_CHUNKING, 10_000)
    rows_out = []
    for level in args.levels:
        todo = [j | {"frames": args.frames} | deploy for j in jobs(level_requests(level), args.seed + 1000 * level)]
        records, wall = closed_loop(talker, todo, level, UPSTREAM_CHUNKING, 10_000)
        rows_out.append(level_row(base, level, records, wall, args.frames / FRAME_RATE))
        print("RESULT:" + json.dumps(rows_out), flush=True)
    print(LEVELS_DONE, flush=True)


def worker_limit(limit: float, deadline: float | None, left: int, least: float = 0.0) -> float:
    """Seconds the next worker may run: its own limit, and under ``--budget-s`` an equal share of what is left among
    the ``left`` configurations still to run (the first no longer starves the rest: a worker that ends early
    leaves its unused share to those after it), but at least ``least`` (``--min-worker-s``) while that much is
    left: shares too short to start a pipeline stop every worker before its first figure (h200_20261205c: 117 s
    each on a fresh machine), so the later configurations are skipped instead."""
    if deadline is None:
        return limit
    left_s = deadline - time.perf_counter()
    return min(limit, max(left_s / left, min(least, left_s), 1.0))


def stop_group(proc: subprocess.Popen, log_path: Path) -> None:
    """End a worker's session: the worker, every stage process it started, and the session of each server it
    started (``SERVER_GROUP`` lines in its log: a server runs in a session of its own, which a worker stopped at its
    limit never ends; on the H100, 2026-12-06, such a server kept 55 GiB and the next configuration's start failed).
    Waits up to 60 s for those servers' processes to go, so that the next configuration finds the GPU free."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
    groups = [int(ln[len(SERVER_GROUP) :]) for ln in text.splitlines() if ln.startswith(SERVER_GROUP)]
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    end = time.monotonic() + 60
    while groups and time.monotonic() < end:
        groups = [g for g in groups if _group_alive(g)]
        time.sleep(0.2)


def _group_alive(group: int) -> bool:
    """Whether a process group still has a member that is not a zombie (a zombie holds no GPU memory; one whose
    parent is gone waits for whoever reaps orphans)."""
    if not Path("/proc").is_dir():
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def wait_worker(proc: subprocess.Popen, log_path: Path, limit: float) -> int:
    """The worker's exit status. A worker that reported all its levels (``LEVELS_DONE`` in its log) and is still
    shutting down ``SHUTDOWN_S`` later is stopped and counts as done (0): its shutdown is not measured and must not
    use the next configuration's share. TimeoutExpired past ``limit`` seconds otherwise."""
    end, done_at = time.perf_counter() + limit, None
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=1.0)
        now = time.perf_counter()
        if done_at is None and LEVELS_DONE in log_path.read_text(encoding="utf-8", errors="replace"):
            done_at = now
        if done_at is not None and now - done_at > SHUTDOWN_S:
            stop_group(proc, log_path)
            return 0
        if now > end:
            raise subprocess.TimeoutExpired(proc.args, limit)


def worker(args: argparse.Namespace) -> None:
    path = args.paths[0]
    profile = "direct" if path == "direct" else args.profiles[0]  # the direct engine runs no deploy profile
    base = {"talker": args.talkers[0], "profile": profile, "path": path, "sampling": "deploy"}
    {"offline": run_offline, "http": run_http, "direct": run_direct}[path](args, base)


# ---------------------------------------------------------------------------------------------------------
# the driver


def main(argv: list[str] | None = None):
    from common import ResultFile, environment, ints_arg, log, package_version, print_table, strs_arg

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--talkers", type=strs_arg, default=list(TALKERS))
    p.add_argument("--profiles", type=strs_arg, default=list(PROFILES))
    p.add_argument("--paths", type=strs_arg, default=list(PATHS))
    p.add_argument("--levels", type=ints_arg, default=None, help="concurrency levels (default 1,4,16,64)")
    p.add_argument("--audio-s", type=float, default=None, help="seconds of audio per request (default 8)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: omni_checkpoint.py's, 4B shape)")
    p.add_argument("--ckpt-dir", default="/tmp/higgs_4b_omni", help="where the random checkpoint is written")
    smoke = "small shape, levels 1,2, 1 s of audio (a GPU run; --paths direct runs on CPU too)"
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument("--worker-timeout", type=int, default=900, help="s per worker process, start-up included")
    p.add_argument("--budget-s", type=float, default=None,
                   help="end the run after this many seconds, each configuration (talker x profile x path) getting "
                        "an equal share of what is left when it starts: a worker over its share is stopped and keeps "
                        "the levels it finished; configurations not started are recorded as skipped")  # fmt: skip
    p.add_argument("--min-worker-s", type=float, default=240.0,
                   help="under --budget-s, each worker may run at least this long while the budget lasts "
                        "(a fresh machine's start: compile, warm-up, graphs); later ones are skipped")  # fmt: skip
    p.add_argument(
        "--jit-verbose",
        action="store_true",
        help="Stage 0 with jit_monitor_verbose: vLLM logs each kernel compiled while serving, with its key",
    )
    p.add_argument("--upstream-profiles", type=strs_arg, default=None,
                   help="the profiles vllm-omni's talker runs (default: each of --profiles without our features); "
                        "e.g. full_decode_64_async,full_decode_64: with and without async scheduling, under which "
                        "its own hand-over sent many requests' audio twice (results/h100_20261206b)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--yaml", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--frames", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.levels = args.levels or ([1, 2] if args.smoke else list(LEVELS))
    args.audio_s = args.audio_s or (1.0 if args.smoke else 8.0)
    upstream_runs = [p for p in PROFILES if p not in UPSTREAM_SAME]  # none of our own features
    for name, allowed in (("talkers", TALKERS), ("profiles", PROFILES), ("paths", PATHS),
                          ("upstream_profiles", upstream_runs)):  # fmt: skip
        bad = [x for x in getattr(args, name) or [] if x not in allowed]
        if bad:
            p.error(f"--{name.replace('_', '-')}: unknown {bad}; choose from {list(allowed)}")
    if args.worker:
        return worker(args)
    missing = [m for m in ("vllm", "vllm_omni") if importlib.util.find_spec(m) is None]
    served = [pa for pa in args.paths if pa != "direct"]  # the direct path runs our engine alone
    if missing and served and (args.budget_s is None or args.budget_s > 0):  # a spent budget starts no worker
        p.exit(2, f"bench_omni.py: --paths {','.join(served)} needs {' and '.join(missing)}, not installed here "
                  "(pip install -e '.[vllm]' on a CUDA machine; or --paths direct)\n")  # fmt: skip
    import torch
    from omni_checkpoint import write_omni_checkpoint

    if args.model is None:
        shape, where = ("small", args.ckpt_dir + "_small") if args.smoke else ("4b", args.ckpt_dir)
        args.model = str(write_omni_checkpoint(where, shape=shape, seed=args.seed))
    frames = round(args.audio_s * FRAME_RATE)
    meta = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"), "bench_omni.py", argv) | {
        "vllm": package_version("vllm"), "vllm_omni": package_version("vllm_omni"), "model": args.model,
        "audio_s": args.audio_s, "frames": frames, "levels": args.levels,
        "sampling": "every path: the profiles' (temperature 1.0, top_p 0.95, top_k 50), seeded",
        "ttfa": "offline: submit -> first audio output (its finish where offline_streamed is false); http: sent -> "
                "first PCM byte; direct: call -> first stream_audio chunk",
        "rtf": "request wall time / audio seconds counted",
        "audio_counted": "each request's audio up to its frames' length (audio_s); over_length: requests that "
                         "returned more (audio_s_max, audio_s_per_s_received: what came)",
        "upstream": f"VLLM_PLUGINS={UPSTREAM_ONLY['VLLM_PLUGINS']} with vllm-omni's own deploy YAMLs",
    }  # fmt: skip
    writer = ResultFile(args.out, "omni", meta, smoke=args.smoke)
    log(f"writing {writer.path}")
    configs = [
        c for t in args.talkers for pa in served for c in talker_configs(t, pa, args.profiles, args.upstream_profiles)
    ]
    configs = list(dict.fromkeys(configs))
    if "direct" in args.paths:
        configs.append(("ours", "direct", "direct"))
    # each of our profiles that differs in a vLLM setting (prefix caching, executor) has an upstream run of its own
    log(f"{len(configs)} workers, in order: " + ", ".join(f"{t} {pr} {pa}" for t, pr, pa in configs))
    deadline = None if args.budget_s is None else time.perf_counter() + args.budget_s
    for index, (talker, profile, path) in enumerate(configs):
        name = f"{talker}_{profile}_{path}"
        if deadline is not None and time.perf_counter() >= deadline:
            writer.add({"talker": talker, "profile": profile, "path": path, "status": "skipped", "error": "--budget-s"})
            continue
        yaml_path = "" if path == "direct" else str(profile_yaml(talker, profile, writer.dir))
        if yaml_path and args.jit_verbose:
            yaml_path = str(jit_verbose_yaml(Path(yaml_path), writer.dir / f"{talker}_{profile}_jit_verbose.yaml"))
        cmd = [sys.executable, __file__, "--worker", "--talkers", talker, "--profiles", profile, "--paths", path,
               "--model", args.model, "--yaml", yaml_path, "--out-dir", str(writer.dir), "--frames", str(frames),
               "--levels", ",".join(map(str, args.levels)), "--seed", str(args.seed),
               "--worker-timeout", str(args.worker_timeout)]  # fmt: skip
        if path == "direct":
            cmd[cmd.index("--profiles") + 1] = PROFILES[0]  # unused by the direct engine
        log_path = writer.path.with_name(f"{writer.path.stem}_{name}.log")
        t0, error = time.perf_counter(), None
        with open(log_path, "w", encoding="utf-8") as sink:
            try:
                # its own session: a timed-out worker is ended with the stage processes it started
                proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=talker_env(talker),
                                        start_new_session=True)  # fmt: skip
                limit = worker_limit(args.worker_timeout + 60 * len(args.levels) * 5, deadline, len(configs) - index,
                                     args.min_worker_s)  # fmt: skip
                code = wait_worker(proc, log_path, limit)
                error = f"worker exited with status {code}" if code else None
            except subprocess.TimeoutExpired as exc:
                error = f"stopped after {exc.timeout:.0f} s (worker timeout or --budget-s)"
            finally:
                stop_group(proc, log_path)
        text = log_path.read_text(encoding="utf-8", errors="replace")
        lines = [x for x in text.splitlines() if x.startswith("RESULT:")]
        rows = json.loads(lines[-1][len("RESULT:") :]) if lines else []
        if path == "http":
            rows = with_stage_stats(rows, writer.dir / f"server_{talker}_{profile}.log")
        for row in rows:
            writer.add(row)
        if error or not lines:
            writer.add({"talker": talker, "profile": profile, "path": path, "status": "error",
                        "error": error or "no result", "log_tail": text[-3000:]})  # fmt: skip
        log(f"{name}: {time.perf_counter() - t0:.0f} s {error or ''}")
    cols = ["talker", "profile", "path", "concurrency", "requests", "ttfa_ms_p50", "ttfa_ms_p90", "rtf_p50", "rtf_p90",
            "audio_s_per_s", "over_length", "s0_step_ms_p50", "status"]  # fmt: skip
    print_table(writer.rows, cols, "vllm-omni pipeline: ours vs upstream talker (TTFA ms, RTF = wall / audio)")
    print(f"wrote {writer.path}")
    return writer


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # stopped by SIGTERM, the run still ends the worker it waits for and that worker's server (stop_group), and a
    # worker its server (run_http)
    with sigterm_as_interrupt():
        main()
