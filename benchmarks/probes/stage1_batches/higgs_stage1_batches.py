"""vllm-omni's Stage-1 code2wav with each step's codec chunks of one length decoded as one batch.

vllm-omni 0.26's ``HiggsAudioV3Code2Wav.forward`` splits a step's flat ids into requests and decodes each request's
chunk alone (``forward_chunk`` -> ``decode_codes``), one after another. ``batch_decodes(cls)`` makes its ``forward``
decode the step's chunks first, one ``decode_codes`` call per chunk length (``decode_by_length``), then run the
original loop, whose ``decode_codes`` calls take the results in order: vllm-omni's own checks, trims and output are
kept. A batch that raises (its codes out of range, say) leaves its chunks to the loop, which decodes each alone, as
before: only a chunk that fails alone fails. A batched chunk's samples differ from the same chunk decoded alone by
float rounding only (the decoder treats each batch row alone).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import after_import

MODULE = "vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_code2wav"


def install() -> None:
    """Patch vllm-omni's code2wav class when its module is imported (once per process)."""
    after_import.install("stage1_batches", {MODULE: lambda module: batch_decodes(module.HiggsAudioV3Code2Wav)})


def decode_by_length(decode: Callable[[Any], Any], chunks: Sequence[Any]) -> list[Any]:
    """Each chunk of codes [Q, T] decoded, the chunks of one length T as one batch: ``decode`` [B, Q, T] -> [B, ...]
    (which checks its codes), one result [1, ...] per chunk in order; None for each chunk of a batch that raised
    (said on stderr: an out-of-memory batch would otherwise measure the unbatched path unseen)."""
    import torch  # here, not at import: sitecustomize imports this module in every process

    out: list[Any] = [None] * len(chunks)
    by_length: dict[int, list[int]] = {}
    for i, codes in enumerate(chunks):
        if codes.numel():
            by_length.setdefault(codes.shape[-1], []).append(i)
    for rows in by_length.values():
        try:
            decoded = decode(torch.stack([chunks[i] for i in rows])).split(1)
        except Exception as exc:  # noqa: BLE001 - decoded again chunk by chunk by the original loop
            print(f"higgs_stage1_batches: a batch of {len(rows)} chunks raised {type(exc).__name__}: {exc}; decoded "
                  "one by one", file=sys.stderr)  # fmt: skip
            continue
        for i, result in zip(rows, decoded, strict=True):
            out[i] = result
    return out


def batch_decodes(cls: type) -> type:
    """Give ``cls`` (vllm-omni's ``HiggsAudioV3Code2Wav`` or a subclass) the batched ``forward``; returns it."""
    forward, decode_codes = cls.forward, cls.decode_codes

    def batched_forward(self, input_ids=None, *args, **kwargs):
        import torch

        if isinstance(input_ids, torch.Tensor) and input_ids.ndim < 3 and input_ids.numel():
            c = self.num_codebooks
            parts = self._split_request_ids(input_ids.reshape(-1).long(), kwargs.get("seq_token_counts"))
            chunks = [p.reshape(c, -1) for p in parts if p.numel() and p.numel() % c == 0]  # the ones it decodes
            with torch.inference_mode():  # as vllm-omni's forward_chunk decodes
                self._higgs_ready = decode_by_length(lambda codes: decode_codes(self, codes), chunks)
        try:
            return forward(self, input_ids, *args, **kwargs)
        finally:
            self._higgs_ready = None

    def queued_decode_codes(self, audio_codes):
        ready = getattr(self, "_higgs_ready", None)
        done = ready.pop(0) if ready else None
        return decode_codes(self, audio_codes) if done is None else done

    cls.forward, cls.decode_codes = batched_forward, queued_decode_codes
    return cls
