"""The codec's configuration: transformers' ``HiggsAudioV2TokenizerConfig``, from constants or a JSON file, checked.

The 4B checkpoint carries no codec config: upstream hard-codes it (SPEC_codec 1.2), and ``HIGGS_V3_CODEC`` holds
the same values. Two of them must always be passed explicitly: ``DacConfig`` otherwise derives
``upsampling_ratios`` (reversed) and ``hidden_size`` (2048) from the encoder side, and the default
``target_bandwidths`` changed between transformers releases (5.14 gives 16 quantizers, SPEC_codec 1.3).
``CodecSpec`` is what our code reads: the derived sizes, computed here once, so no transformers property
whose meaning moved between releases is consulted twice.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CODEC_CONFIG_FILE = "codec_config.json"  # our file beside a checkpoint's config.json (the tiny one has it)
TOKENIZER_MODEL_TYPE = "higgs_audio_v2_tokenizer"

_REAL_DAC = dict(
    model_type="dac",
    encoder_hidden_size=64,
    downsampling_ratios=[8, 5, 4, 2, 3],
    upsampling_ratios=[8, 5, 4, 2, 3],
    decoder_hidden_size=1024,
    hidden_size=256,
    hop_length=960,
    sampling_rate=24000,
)
# HuBERT-base, as bosonai/higgs-audio-v2-tokenizer's config.json has it (SPEC_codec 1.3 [UNCERTAIN]: read from a
# third-party copy). mask_time_prob is 0: inference never masks, and a positive value adds masked_spec_embed.
_REAL_HUBERT = dict(
    model_type="hubert",
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=3072,
    conv_dim=[512] * 7,
    conv_kernel=[10, 3, 3, 3, 3, 2, 2],
    conv_stride=[5, 2, 2, 2, 2, 2, 2],
    mask_time_prob=0.0,
)
_SHARED = dict(
    sample_rate=24000,
    semantic_sample_rate=16000,
    downsample_factor=320,
    codebook_size=1024,
    codebook_dim=64,
    target_bandwidths=[0.5, 1, 1.5, 2],
    kernel_size=3,
    unit_kernel_size=3,
    strides=[1, 1],
    channel_ratios=[1, 1],
    block_dilations=[1, 1],
)
HIGGS_V3_CODEC: dict[str, Any] = dict(_SHARED, acoustic_model_config=_REAL_DAC, semantic_model_config=_REAL_HUBERT)

# SPEC_codec 8: the real strides (hop 960, the same +-10 frame receptive field) and the real quantizer shapes
# (8 x 1024 x 64) with 117k parameters; a one-layer HuBERT of width 16.
TINY_CODEC: dict[str, Any] = dict(
    _SHARED,
    acoustic_model_config=dict(
        _REAL_DAC,
        encoder_hidden_size=2,
        decoder_hidden_size=32,
        hidden_size=8,
        n_codebooks=1,
        codebook_size=16,
        codebook_dim=4,
    ),  # fmt: skip
    semantic_model_config=dict(
        _REAL_HUBERT,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=[8] * 7,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    ),  # fmt: skip
)


@dataclass(frozen=True)
class CodecSpec:
    """The sizes our code uses, derived from a codec config and checked against each other."""

    sample_rate: int  # Hz of decoded audio and of the acoustic encoder's input
    hop_length: int  # samples per frame (the product of the DAC strides)
    num_quantizers: int  # codes per frame
    codebook_size: int
    codebook_dim: int
    hidden_size: int  # RVQ width: acoustic + semantic hidden sizes
    semantic_sample_rate: int
    semantic_downsample: int  # HuBERT frames per codec frame

    @property
    def frame_rate(self) -> int:
        return self.sample_rate // self.hop_length


def build_config(raw: Mapping[str, Any]):
    """A ``HiggsAudioV2TokenizerConfig`` from a dict (``HIGGS_V3_CODEC``, a JSON file), checked by ``spec_of``."""
    from transformers.models.higgs_audio_v2_tokenizer.configuration_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerConfig,
    )

    if not isinstance(raw, Mapping):
        raise ValueError(f"a codec config must be a JSON object, got {type(raw).__name__}")
    fields = json.loads(json.dumps(dict(raw)))  # a deep copy: transformers 5.3 edits sub-config dicts in place
    model_type = fields.pop("model_type", TOKENIZER_MODEL_TYPE)
    if model_type != TOKENIZER_MODEL_TYPE:
        raise ValueError(f"codec config model_type is {model_type!r}, expected {TOKENIZER_MODEL_TYPE!r}")
    for name in ("acoustic_model_config", "semantic_model_config", "target_bandwidths"):
        if name not in fields:  # transformers' defaults for these are a different codec (SPEC_codec 1.3)
            raise ValueError(f"codec config has no {name!r}; the defaults describe a different codec")
    try:
        config = HiggsAudioV2TokenizerConfig(**fields)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"invalid codec config: {exc}") from exc
    spec_of(config)
    return config


def spec_of(config) -> CodecSpec:
    """Derived sizes of a ``HiggsAudioV2TokenizerConfig``; ``ValueError`` naming the first inconsistency."""
    acoustic, semantic = config.acoustic_model_config, config.semantic_model_config
    if getattr(acoustic, "model_type", None) != "dac":
        raise ValueError(f"codec acoustic_model_config must be a 'dac' config, got {acoustic!r:.80}")
    if getattr(semantic, "model_type", None) != "hubert":
        raise ValueError(f"codec semantic_model_config must be a 'hubert' config, got {semantic!r:.80}")
    up, down = list(acoustic.upsampling_ratios), list(acoustic.downsampling_ratios)
    if not up or any(not isinstance(s, int) or s <= 0 for s in up + down):
        raise ValueError(f"codec DAC strides must be positive integers, got up {up} / down {down}")
    hop = math.prod(up)
    if math.prod(down) != hop:
        raise ValueError(f"codec DAC decodes {math.prod(up)} samples per frame but encodes {math.prod(down)}")
    sample_rate, semantic_rate = int(config.sample_rate), int(config.semantic_sample_rate)
    if sample_rate <= 0 or sample_rate % hop:
        raise ValueError(f"codec sample_rate {sample_rate} is not a whole number of {hop}-sample frames per second")
    frame_rate = sample_rate // hop
    size, dim = int(config.codebook_size), int(config.codebook_dim)
    if size < 2 or dim < 1:
        raise ValueError(f"codec codebook_size {size} / codebook_dim {dim} must be >= 2 / >= 1")
    bandwidths = list(config.target_bandwidths)
    if not bandwidths:
        raise ValueError("codec target_bandwidths is empty")
    bits = math.ceil(math.log2(size))
    num_quantizers = int(1000 * bandwidths[-1] // (frame_rate * bits))  # as transformers counts them
    if num_quantizers < 1:
        raise ValueError(f"codec target_bandwidths {bandwidths} give no quantizer at {frame_rate} frames/s")
    if semantic_rate <= 0 or (hop * semantic_rate) % sample_rate:
        raise ValueError(f"codec semantic_sample_rate {semantic_rate} splits a {hop}-sample frame unevenly")
    per_frame = hop * semantic_rate // sample_rate  # semantic-rate samples per codec frame
    if config.downsample_factor <= 0 or per_frame % config.downsample_factor:
        raise ValueError(
            f"codec downsample_factor {config.downsample_factor} does not divide the {per_frame} semantic samples "
            "of one frame"
        )
    if len(config.strides) != len(config.channel_ratios):
        raise ValueError(f"codec strides {config.strides} and channel_ratios {config.channel_ratios} differ in length")
    return CodecSpec(
        sample_rate=sample_rate,
        hop_length=hop,
        num_quantizers=num_quantizers,
        codebook_size=size,
        codebook_dim=dim,
        hidden_size=int(acoustic.hidden_size) + int(semantic.hidden_size),
        semantic_sample_rate=semantic_rate,
        semantic_downsample=per_frame // config.downsample_factor,
    )


def read_config_file(file: Path):
    """Parse and build the codec config in ``file`` (``ValueError`` naming the file on any problem)."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not a readable JSON file: {exc}") from exc
    try:
        return build_config(raw)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from exc


def config_to_dict(config) -> dict[str, Any]:
    """The JSON form of a codec config (what ``build_config`` reads back)."""
    out = config.to_dict()
    for key in ("transformers_version", "dtype", "torch_dtype"):
        out.pop(key, None)
    return out
