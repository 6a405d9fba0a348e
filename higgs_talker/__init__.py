"""higgs_talker: the Stage-0 talker of Higgs-Audio V3 TTS (Qwen3 backbone + eight-codebook heads).

``import higgs_talker`` imports neither vLLM nor FlashInfer, nor torch until a name below is first used (PEP 562:
the CLI installs its Ctrl-C handler before the second it takes to import torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "GenerationCancelled": ".api",
    "GenerationError": ".api",
    "GenerationResult": ".api",
    "HiggsTalker": ".api",
    "Reference": ".api",
    "SamplingParams": ".heads.sampling",
    "SpecialTokens": ".config",
    "TalkerConfig": ".config",
    "TextConfig": ".config",
    "WarmupReport": ".kernel_cache",
    "warmup": ".kernel_cache",
}
__all__ = [
    "GenerationCancelled",
    "GenerationError",
    "GenerationResult",
    "HiggsTalker",
    "Reference",
    "SamplingParams",
    "SpecialTokens",
    "TalkerConfig",
    "TextConfig",
    "WarmupReport",
    "warmup",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
    from .api import GenerationCancelled, GenerationError, GenerationResult, HiggsTalker, Reference
    from .config import SpecialTokens, TalkerConfig, TextConfig
    from .heads.sampling import SamplingParams
    from .kernel_cache import WarmupReport, warmup
