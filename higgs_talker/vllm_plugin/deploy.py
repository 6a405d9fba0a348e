"""Deploy profiles for vllm-omni (``vllm-omni serve MODEL --omni --deploy-config PATH``), shipped as package data."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ..codec.streaming import chunk_due, ramped_rule

DEPLOY_DIR = Path(__file__).with_name("deploy")
PROFILES = {n: n.replace("-", "_") + ".yaml" for n in ("high-throughput", "low-latency", "full-decode", "default")}


def deploy_config_path(name: str) -> Path:
    """Path of a profile's YAML: a name of ``PROFILES`` (underscores also accepted)."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in PROFILES:
        raise ValueError(f"unknown deploy profile {name!r}; choose one of {', '.join(PROFILES)}")
    path = DEPLOY_DIR / PROFILES[key]
    if not path.is_file():
        raise FileNotFoundError(f"deploy profile {key!r} is missing from the installed package ({path})")
    return path


RAMP_KEY = "codec_chunk_ramp"  # a connector extra our hand-over reads: chunks ramped (codec AudioChunking.ramp)
_ENDED_OUTSIDE_A_STEP = frozenset(("FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR"))  # RequestStatus names


def talker2code2wav_async_chunk(transfer_manager, multimodal_output, request, is_finished: bool = False):
    """vllm-omni's Higgs hand-over to code2wav told the finished flag its call was queued with (for a deploy YAML's
    ``custom_process_next_stage_input_func``): vllm-omni's own doubles EOS-ended audio under async scheduling.
    Where the connector's extra sets ``RAMP_KEY``, each chunk after the first is as long as the frames already
    sent (``codec.streaming.chunk_due``), so a player is not left waiting after a one-frame first chunk."""
    from vllm_omni.model_executor.stage_input_processors import higgs_audio_v3

    ended = getattr(getattr(request, "status", None), "name", "") in _ENDED_OUTSIDE_A_STEP
    # is_finished(): the flag its call was queued with, or True once the request ended outside a step
    queued = _Overlay(request, is_finished=lambda: bool(is_finished) or ended, external_req_id=request.external_req_id)
    manager = _ramped(transfer_manager, request)
    return higgs_audio_v3.talker2code2wav_async_chunk(manager, multimodal_output, queued, is_finished)


def _ramped(manager, request):
    """``manager`` as vllm-omni's hand-over reads it, its connector's chunk size the ramp's for this request."""
    config = getattr(getattr(manager, "connector", None), "config", None)
    extra = config.get("extra", config) if isinstance(config, dict) else None
    emitted = (getattr(manager, "higgs_v3_emitted_frames", None) or {}).get(request.external_req_id, 0)
    if not isinstance(extra, dict) or not extra.get(RAMP_KEY) or not emitted:
        return manager  # the first chunk: vllm-omni's initial_codec_chunk_frames as it is
    chunk = int(extra.get("codec_chunk_frames", 25))
    due = chunk_due(emitted, ramped_rule(chunk, int(extra.get("initial_codec_chunk_frames") or chunk)))
    if due == chunk:  # past the ramp: the connector's own chunk size (most calls; an overlay costs each read)
        return manager
    return _Overlay(manager, connector=SimpleNamespace(config={"extra": extra | {"codec_chunk_frames": due}}))


class _Overlay:
    """``target`` with ``attrs`` read in place of its own; every other read, and every write, is the target's."""

    def __init__(self, target, **attrs) -> None:
        object.__setattr__(self, "_target", target)
        vars(self).update(attrs)

    def __getattr__(self, name: str):
        return getattr(self._target, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._target, name, value)
