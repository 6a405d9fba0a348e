"""Deploy profiles for vllm-omni (``vllm-omni serve MODEL --omni --deploy-config PATH``), shipped as package data."""

from __future__ import annotations

from pathlib import Path

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


def talker2code2wav_async_chunk(transfer_manager, multimodal_output, request, is_finished: bool = False):
    """vllm-omni's Higgs hand-over to code2wav told the finished flag its call was queued with (for a deploy YAML's
    ``custom_process_next_stage_input_func``): vllm-omni's own doubles EOS-ended audio under async scheduling."""
    from vllm_omni.model_executor.stage_input_processors import higgs_audio_v3

    queued = _AsQueued(request, bool(is_finished))
    return higgs_audio_v3.talker2code2wav_async_chunk(transfer_manager, multimodal_output, queued, is_finished)


class _AsQueued:
    """``is_finished()``: the request's flag when its call was queued, or True once it ended outside a step."""

    ENDED_OUTSIDE_A_STEP = frozenset(("FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR"))  # RequestStatus names

    def __init__(self, request, finished: bool) -> None:
        ended = getattr(getattr(request, "status", None), "name", "") in self.ENDED_OUTSIDE_A_STEP
        self._request, self.is_finished = request, lambda: finished or ended

    def __getattr__(self, name: str):
        return getattr(self._request, name)
