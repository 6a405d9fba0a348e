"""vLLM / vllm-omni plugin for the Higgs-Audio V3 talker.

``register()`` is the entry point of both ``vllm.general_plugins`` and ``vllm_omni.general_plugins``: it names our
class (a lazy ``"module:Class"`` string) for ``ARCHITECTURES`` in vllm-omni's and vLLM's model registries (and, where
vllm-omni is installed, our Stage 1 for ``CODEC_ARCH``) and registers our HF config if nothing has.
Importing this package imports neither vLLM nor vllm-omni.
"""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)

TALKER_CLASS = "higgs_talker.vllm_plugin.talker:HiggsTalkerForConditionalGeneration"
# The Stage-0 architecture vllm-omni's pipeline names, the checkpoint's HF architecture, and an alias that
# only this plugin registers (nothing else can overwrite it).
ARCHITECTURES = ("HiggsAudioV3TalkerForConditionalGeneration", "HiggsMultimodalQwen3ForConditionalGeneration",
                 "HiggsTalkerForConditionalGeneration")  # fmt: skip
# Stage 1 with a step's codec chunks decoded in batches (code2wav.py), for a deploy YAML's Stage-1 model_arch
CODEC_ARCH, CODEC_CLASS = "HiggsTalkerCode2Wav", "higgs_talker.vllm_plugin.code2wav:HiggsTalkerCode2Wav"
CODEC_GRAPH_FRAMES = "higgs_codec_graph_frames"  # its hf_overrides key: window lengths it decodes in CUDA graphs
# The text-only bridge for plain vLLM: pass ``logits_processors=[TEXT_ONLY_BRIDGE]`` to ``vllm.LLM``.
TEXT_ONLY_BRIDGE = "higgs_talker.vllm_plugin.bridge:TextOnlyBridge"
# ``vllm.LLM(..., worker_extension_cls=ROWS_EXTENSION)``: ``bridge.request_rows`` asks workers by method name
ROWS_EXTENSION = "higgs_talker.vllm_plugin.bridge.RowsWorkerExtension"

_touched: tuple[str, ...] | None = None


def _log_through_vllm() -> None:
    """Our log lines (the graph decision, warnings) in vLLM's log: the package logger takes the handlers and level
    of vLLM's, unless it or the root logger has handlers (an application that set up its own logging)."""
    ours, host = logging.getLogger("higgs_talker"), logging.getLogger("vllm")
    if host.handlers and not ours.handlers and not logging.getLogger().handlers:
        ours.handlers, ours.propagate = list(host.handlers), False
        ours.setLevel(host.getEffectiveLevel())


def register() -> tuple[str, ...]:
    """Register our talker class for ``ARCHITECTURES``; returns the registries touched (idempotent)."""
    global _touched
    touched, classes = [], dict.fromkeys(ARCHITECTURES, TALKER_CLASS)
    # vllm-omni first: importing it registers its own HF config for higgs_multimodal_qwen3 (which would raise
    # if ours were registered before it).
    if importlib.util.find_spec("vllm_omni") is not None:
        from vllm_omni.model_executor.models import registry as omni_registry

        classes[CODEC_ARCH] = CODEC_CLASS
        for arch, cls in classes.items():
            omni_registry.OmniModelRegistry.register_model(arch, cls)
            # vllm-omni's own vllm.general_plugins entry may copy its model table into vLLM's registry after us
            # (entry points run in no set order): without our architectures it cannot put its talker back.
            getattr(omni_registry, "_OMNI_MODELS", {}).pop(arch, None)
        touched.append("vllm_omni.OmniModelRegistry")
    if importlib.util.find_spec("vllm") is not None:
        from vllm.model_executor.models import ModelRegistry

        _log_through_vllm()
        for arch, cls in classes.items():
            ModelRegistry.register_model(arch, cls)
        touched.append("vllm.ModelRegistry")
    from ..config import register_hf_config

    if register_hf_config():
        touched.append("transformers.AutoConfig")
    if _touched is None:
        logger.info("higgs_talker vLLM plugin: %s -> %s (%s)", ", ".join(ARCHITECTURES), TALKER_CLASS, touched)
    _touched = tuple(touched) if _touched is None else tuple(dict.fromkeys(_touched + tuple(touched)))
    return _touched


__all__ = ["ARCHITECTURES", "CODEC_ARCH", "CODEC_CLASS", "CODEC_GRAPH_FRAMES", "ROWS_EXTENSION", "TALKER_CLASS",
           "TEXT_ONLY_BRIDGE", "register"]  # fmt: skip
