"""Deploy profiles for vllm-omni (``vllm-omni serve MODEL --omni --deploy-config PATH``), shipped as package data."""

from __future__ import annotations

from pathlib import Path

import torch

from ..codec.streaming import RAMP_KEY, connector_rule, delayed_rows_chunk

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


_ENDED_OUTSIDE_A_STEP = frozenset(("FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR"))  # RequestStatus names


def talker2code2wav_async_chunk(transfer_manager, multimodal_output, request, is_finished: bool = False):
    """The Stage 0 -> Stage 1 hand-over (a deploy YAML's ``custom_process_next_stage_input_func``): vllm-omni's Higgs
    payloads, cut by ``codec.streaming`` from the rows kept in ``code_prompt_token_ids``. Unlike vllm-omni's own: the
    finished flag is the one the call was queued with (vllm-omni's reads the live state: EOS-ended audio twice under
    async scheduling), every row of a call is kept, and with the connector's ``RAMP_KEY`` the chunks ramp."""
    rid = request.external_req_id
    finished = bool(is_finished) or getattr(getattr(request, "status", None), "name", "") in _ENDED_OUTSIDE_A_STEP
    rows = transfer_manager.code_prompt_token_ids[rid]
    audio = (multimodal_output.get("codes") or {}).get("audio") if isinstance(multimodal_output, dict) else None
    if isinstance(audio, torch.Tensor) and audio.numel():
        rows.extend(audio.tolist()) if audio.dim() == 2 else rows.append(audio.tolist())
    elif not isinstance(multimodal_output, dict) and not finished:
        return None
    sent = vars(transfer_manager).setdefault("higgs_v3_emitted_frames", {})  # vllm-omni's name: frames sent
    emitted = sent.pop(rid, 0) if finished else sent.get(rid, 0)
    config = getattr(getattr(transfer_manager, "connector", None), "config", None)
    rule = connector_rule(config.get("extra", config) if isinstance(config, dict) else {})
    chunk = delayed_rows_chunk(rows, emitted, finished, rule)
    if chunk is None and not finished:
        return None
    from vllm_omni.data_entry_keys import CodesStruct, MetaStruct, OmniPayloadStruct

    if chunk is None:
        return OmniPayloadStruct(codes=CodesStruct(audio=torch.empty(0, dtype=torch.long)),
                                 meta=MetaStruct(finished=torch.tensor(True)))  # fmt: skip
    window, frames = chunk
    if not finished:
        sent[rid] = window.emit_end
    meta = MetaStruct(left_context_size=window.emit_start - window.start, right_holdback_size=window.end -
                      window.emit_end, finished=torch.tensor(finished))  # fmt: skip
    return OmniPayloadStruct(codes=CodesStruct(audio=frames.t().reshape(-1)), meta=meta)


__all__ = ["PROFILES", "RAMP_KEY", "deploy_config_path", "talker2code2wav_async_chunk"]
