"""Audio heads: the fused codebook embedding/head, the delay pattern, and code sampling."""

from .codebooks import FusedCodebookEmbedding, FusedCodebookHead
from .delay import DelayState, apply_delay_mask, apply_delay_pattern, codec_frames, revert_delay_pattern, update_state
from .sampling import SamplingParams, sample_codes

__all__ = [
    "DelayState",
    "FusedCodebookEmbedding",
    "FusedCodebookHead",
    "SamplingParams",
    "apply_delay_mask",
    "apply_delay_pattern",
    "codec_frames",
    "revert_delay_pattern",
    "sample_codes",
    "update_state",
]
