"""higgs_talker: the Stage-0 talker of Higgs-Audio V3 TTS (Qwen3 backbone + eight-codebook heads).

``import higgs_talker`` imports neither vLLM nor FlashInfer.
"""

from .api import GenerationCancelled, GenerationError, GenerationResult, HiggsTalker, Reference
from .config import SpecialTokens, TalkerConfig, TextConfig
from .heads.sampling import SamplingParams
from .kernel_cache import WarmupReport, warmup

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
__version__ = "0.1.0"
