"""Stage 1: the Higgs audio codec on transformers' DAC and HuBERT modules (codes <-> 24 kHz audio).

Building a codec (or its config) imports transformers' DAC and HuBERT code, never torchaudio;
``import higgs_talker`` does not import this package at all.
"""

from .codec import Codec, check_waveform, random_tensors
from .config import CODEC_CONFIG_FILE, HIGGS_V3_CODEC, TINY_CODEC, CodecSpec, build_config, config_to_dict
from .streaming import (
    FAST_START_CHUNKING,
    UPSTREAM_CHUNKING,
    AudioChunking,
    StreamingDecoder,
    Window,
    chunk_due,
    next_window,
)
from .weights import find_source

__all__ = [
    "CODEC_CONFIG_FILE",
    "FAST_START_CHUNKING",
    "HIGGS_V3_CODEC",
    "TINY_CODEC",
    "UPSTREAM_CHUNKING",
    "AudioChunking",
    "Codec",
    "CodecSpec",
    "StreamingDecoder",
    "Window",
    "build_config",
    "check_waveform",
    "chunk_due",
    "config_to_dict",
    "find_source",
    "next_window",
    "random_tensors",
]
