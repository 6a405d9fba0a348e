"""Stage 1 for vllm-omni: its code2wav codec with a step's chunks of one length decoded as one batch.

vllm-omni (0.26 - 0.30) decodes each request's chunk of a Stage-1 step alone, one after another, each with a range
check that syncs the host twice. Here the step's chunks decode first, one batch per length, and vllm-omni's own
``forward`` then runs, its per-chunk decodes taking those results in order (``codec.codec.DecodedAhead``): its
splits, checks, trims and output stay its own. A batch that fails the check (a code out of range) or runs out of
memory is left to the per-chunk decodes, where only a request at fault gets vllm-omni's empty audio. Stage 1 runs
eagerly: the window lengths a deploy YAML names in Stage 1's ``hf_overrides`` (``CODEC_GRAPH_FRAMES``) decode
through CUDA graphs (``cuda_graphs.codec``, captured at load, each checked against eager), their codes range-checked
once a batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_code2wav import HiggsAudioV3Code2Wav

from ..codec.codec import DecodedAhead
from ..cuda_graphs.codec import CodecGraphs
from . import CODEC_GRAPH_FRAMES

_LEFT_TO_THE_LOOP = (ValueError, torch.OutOfMemoryError)  # what a batch may raise: its chunks then decode alone


class HiggsTalkerCode2Wav(HiggsAudioV3Code2Wav):
    """vllm-omni's Higgs-Audio V3 Stage 1 with batched decodes (a deploy YAML's Stage-1 ``model_arch``: CODEC_ARCH)."""

    _ahead: DecodedAhead | None = None  # the step's chunks, decoded before vllm-omni's loop asks for them
    _graphs: CodecGraphs | None = None

    def load_weights(self, *args: Any, **kwargs: Any):
        loaded = super().load_weights(*args, **kwargs)
        device, frames = next(self.parameters()).device, self.graph_frames()
        if frames and device.type == "cuda" and self._graphs is None:
            self._graphs = CodecGraphs(super().decode_codes, self.num_codebooks, self.num_real_codes, device)
            self._graphs.capture(frames)
        return loaded

    def graph_frames(self) -> list[int]:
        """The window lengths Stage 1's ``hf_overrides`` names under ``CODEC_GRAPH_FRAMES``; none (no graphs) unless
        Stage 1 runs eagerly (``enforce_eager``: where vLLM captures graphs of its own, ours stay out of them)."""
        mc = getattr(getattr(self, "vllm_config", None), "model_config", None)
        overrides = getattr(mc, "hf_overrides", None)
        if not isinstance(overrides, dict) or not getattr(mc, "enforce_eager", False):
            return []
        return [int(t) for t in overrides.get(CODEC_GRAPH_FRAMES) or []]

    def _decode_batch(self, codes: Tensor) -> Tensor:
        """vllm-omni's decode of chunks [B, Q, T], replayed from a graph where one was captured for T (after the
        range check: a replay runs no Python)."""
        wav = None if self._graphs is None else self._graphs.decode(self._validate_codes(codes))
        return wav if wav is not None else super().decode_codes(codes)

    def forward(self, input_ids: Tensor | None = None, *args: Any, **kwargs: Any):
        if isinstance(input_ids, Tensor) and input_ids.ndim < 3 and input_ids.numel():
            c, ids = self.num_codebooks, input_ids.reshape(-1).long()
            parts = self._split_request_ids(ids, kwargs.get("seq_token_counts"))
            chunks = [p.reshape(1, c, -1) for p in parts if p.numel() and p.numel() % c == 0]  # the ones it decodes
            self._ahead = DecodedAhead(self._decode_batch, chunks, _LEFT_TO_THE_LOOP)
        try:
            return super().forward(input_ids, *args, **kwargs)
        finally:
            self._ahead = None

    def decode_codes(self, audio_codes: Tensor) -> Tensor:
        """The step's batched decode of ``audio_codes`` [1, Q, T] where one waits, else vllm-omni's own."""
        audio = self._ahead.take(audio_codes) if self._ahead is not None else None
        return audio if audio is not None else super().decode_codes(audio_codes)
