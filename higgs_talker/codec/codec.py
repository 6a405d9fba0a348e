"""``Codec``: the Stage-1 codec of Higgs-Audio V3: codes [T, Q] int64 <-> 24 kHz mono float32 waveform [T * hop].

``Codec.from_pretrained(dir)`` loads the codec bundled in a talker checkpoint, or an audio tokenizer
directory in transformers' layout (``weights.py``); ``Codec.from_config(cfg)`` builds one with random weights
(the tiny checkpoint, benchmarks). Decoding returns float32 as decoded, unclipped (SPEC_codec 3.3); only
writing 16-bit PCM clips (``higgs_talker.audio``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .config import CodecSpec, build_config, spec_of
from .model import CodecModel, decoder_reach, unused_shapes
from .resample import resample
from .streaming import WindowBatcher
from .weights import assemble, expected_shapes, find_source, load_model

logger = logging.getLogger(__name__)

MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 384_000
_DTYPES = (torch.float32, torch.bfloat16)


class Codec:
    """The codec on one device: ``decode(codes [T, Q]) -> [T * hop]`` fp32 and ``encode(wav, rate) -> [T, Q]``."""

    def __init__(self, model: CodecModel, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.spec: CodecSpec = model.spec
        self.context_frames: tuple[int, int] = decoder_reach(model.acoustic_decoder, self.spec.hop_length)
        self.windows = WindowBatcher(self)  # the streams' decodes, batched while one runs
        # graphs of the streamed window decodes, once captured (``cuda_graphs.codec``): ``decode(codes) -> wav or None``
        self.graphs = None
        self._stream: torch.cuda.Stream | None = None  # the streamed decodes' CUDA stream (decode_windows_to_host)

    # ------------------------------------------------------------------------------------------ building

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        encoder: bool = False,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = torch.float32,
    ) -> Codec:
        """Load the codec of a talker checkpoint directory (bundled keys) or of an audio tokenizer directory.

        ``encoder=False`` reads only what decoding needs (21.6M of the 4B codec's 201M values); ``encoder=True``
        also the semantic model and encoders, which ``encode`` needs.
        """
        device, dtype = _check_device(device), _check_dtype(dtype)
        source = find_source(path)
        if source is None:
            raise ValueError(f"{path} holds no codec: no keys under the codec prefix and no audio tokenizer config")
        model = load_model(source, encoder, device, dtype)
        logger.info("loaded the codec of %s (%s, %s, encoder=%s)", path, device, dtype, encoder)
        return cls(model, device, dtype)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any] | object,
        *,
        encoder: bool = True,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = torch.float32,
        seed: int = 0,
    ) -> Codec:
        """A codec with random weights (``random_tensors``) for a config dict or ``HiggsAudioV2TokenizerConfig``."""
        device, dtype = _check_device(device), _check_dtype(dtype)
        config = build_config(config) if isinstance(config, Mapping) else config
        tensors = random_tensors(config, seed=seed, device=device, training_state=False, encoder=encoder)
        return cls(assemble(tensors, config, encoder, device, dtype), device, dtype)

    # ------------------------------------------------------------------------------------------ sizes

    @property
    def sample_rate(self) -> int:
        return self.spec.sample_rate

    @property
    def hop_length(self) -> int:
        return self.spec.hop_length

    @property
    def frame_rate(self) -> int:
        return self.spec.frame_rate

    @property
    def num_quantizers(self) -> int:
        return self.spec.num_quantizers

    @property
    def codebook_size(self) -> int:
        return self.spec.codebook_size

    @property
    def can_encode(self) -> bool:
        return self.model.has_encoder

    def frames_for(self, samples: int) -> int:
        """Frames ``encode`` makes of ``samples`` at the codec rate (SPEC_codec 5.4)."""
        s = self.spec
        semantic = -(-samples * s.semantic_sample_rate // s.sample_rate) + 320  # resampled, padded 160 each side
        hubert = semantic
        for k, stride in zip(self.model.config.semantic_model_config.conv_kernel,
                             self.model.config.semantic_model_config.conv_stride, strict=True):  # fmt: skip
            hubert = (hubert - k) // stride + 1
        return -(-hubert // s.semantic_downsample) if hubert > 0 else 0

    # ------------------------------------------------------------------------------------------ decoding

    @torch.inference_mode()
    def decode(self, codes: Tensor | np.ndarray) -> Tensor:
        """codes [T, Q] integer in [0, codebook_size) -> waveform [T * hop] float32 on the codec's device."""
        codes = self.check_codes(codes)
        if codes.shape[0] == 0:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        wav = self.model.decode(codes.to(self.device).t()[None])  # [1, 1, T * hop]
        return wav.reshape(-1).float()

    @torch.inference_mode()
    def decode_windows(self, windows: Sequence[tuple[Tensor, int, int]]) -> list[Tensor]:
        """Decode windows (checked codes [T, Q], trim_front, trim_back), each without the samples of its first
        ``trim_front`` and last ``trim_back`` frames; the windows of one length T decode as one batch
        (``decode_by_length``). One waveform per window."""
        hop, empty = self.hop_length, torch.zeros(0, dtype=torch.float32, device=self.device)
        chunks = [codes.t()[None] for codes, _, _ in windows]  # [1, Q, T]
        decoded = decode_by_length(self._decode_batch, chunks)
        out = []
        for (_, front, back), wav in zip(windows, decoded, strict=True):
            samples = empty if wav is None else wav.reshape(-1)
            out.append(samples[front * hop : samples.shape[0] - back * hop])
        return out

    @torch.inference_mode()
    def decode_windows_to_host(self, windows: Sequence[tuple[Tensor, int, int]]) -> list[Tensor]:
        """``decode_windows`` with the waveforms on the host (CPU float32), as a stream hands them on. On CUDA the
        decode and its copy run on a high-priority stream of the codec's own: a chunk then waits neither for the
        work queued before it on the default stream (a talker's decode steps: up to two in flight under async
        scheduling, one of them started after the chunk's frames existed) nor for the device to drain it."""
        if self.device.type != "cuda":
            return self.decode_windows(windows)
        if self._stream is None:
            stream = torch.cuda.Stream(self.device, priority=-1)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights and graphs exist on it
            self._stream = stream
        with torch.cuda.stream(self._stream):
            waves = self.decode_windows(windows)
            host = torch.cat(waves).cpu() if waves else torch.zeros(0)  # one copy; waits for this stream only
        return list(host.split([w.shape[0] for w in waves]))

    def _decode_batch(self, codes: Tensor) -> Tensor:
        """codes [B, Q, T] -> [B, 1, T * hop] float32: a captured graph's replay where one fits, else eager."""
        codes = codes.to(self.device)
        wav = None if self.graphs is None else self.graphs.decode(codes)
        return (wav if wav is not None else self.model.decode(codes)).float()

    def check_codes(self, codes: Tensor | np.ndarray) -> Tensor:
        """Codes as an int64 CPU or device tensor [T, Q]; ``TypeError`` / ``ValueError`` naming what is wrong."""
        if isinstance(codes, np.ndarray):
            if codes.dtype.kind not in "iu":
                raise TypeError(f"codes must be an integer array, got dtype {codes.dtype}")
            codes = torch.from_numpy(codes.astype(np.int64, copy=False))
        if not isinstance(codes, Tensor):
            raise TypeError(f"codes must be a tensor or numpy array [frames, {self.num_quantizers}], got "
                            f"{type(codes).__name__}")  # fmt: skip
        if codes.dtype.is_floating_point or codes.is_complex() or codes.dtype == torch.bool:
            raise TypeError(f"codes must be integers, got dtype {codes.dtype}")
        q = self.num_quantizers
        if codes.dim() != 2 or codes.shape[1] != q:
            raise ValueError(f"codes must have shape [frames, {q}], got {list(codes.shape)}")
        codes = codes.long()
        if codes.numel():
            lo, hi = int(codes.min()), int(codes.max())
            if lo < 0 or hi >= self.codebook_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"code {bad} is outside the codebook range [0, {self.codebook_size})")
        return codes

    # ------------------------------------------------------------------------------------------ encoding

    @torch.inference_mode()
    def encode(self, waveform: Tensor | np.ndarray, sample_rate: int) -> Tensor:
        """waveform [N] or [C, N] at ``sample_rate`` -> codes [T, Q] int64 (CPU), T = ``frames_for`` at 24 kHz.

        Channels are averaged to mono and the audio resampled to the codec rate, as upstream prepares
        reference audio (SPEC_codec 5.1-5.2).
        """
        if not self.can_encode:
            raise ValueError("this codec was loaded for decoding only; load it with encoder=True to encode audio")
        wav = check_waveform(waveform, sample_rate)
        wav = resample(wav.to(self.device), sample_rate, self.sample_rate)
        if self.frames_for(wav.shape[-1]) < 1:
            raise ValueError(
                f"audio of {wav.shape[-1] / self.sample_rate * 1e3:.1f} ms is too short to encode one "
                f"{1e3 / self.frame_rate:.0f} ms frame"
            )
        codes = self.model.encode(wav[None, None])  # [1, Q, T]
        return codes[0].t().contiguous().cpu()

    def stream(self, chunking=None):
        """A ``StreamingDecoder`` over this codec: push frames, get waveform chunks (``streaming.py``)."""
        from .streaming import StreamingDecoder

        return StreamingDecoder(self, chunking)


def decode_by_length(
    decode: Callable[[Tensor], Tensor], chunks: Sequence[Tensor], skip: tuple[type[Exception], ...] = ()
) -> list[Tensor | None]:
    """Each chunk [1, ..., T] decoded, the chunks of one length T as one batch (``decode`` [B, ..., T] -> [B, ...]; a
    decoder that treats each batch row alone): one result [1, ...] per chunk, in order. None for an empty chunk and
    for each chunk of a batch whose decode raised one of ``skip`` (left to be decoded alone)."""
    out: list[Tensor | None] = [None] * len(chunks)
    groups: dict[int, list[int]] = {}
    for i, chunk in enumerate(chunks):
        if chunk.numel():
            groups.setdefault(chunk.shape[-1], []).append(i)
    for rows in groups.values():
        try:
            decoded = decode(torch.cat([chunks[i] for i in rows])).split(1)
        except skip:
            continue
        for i, result in zip(rows, decoded, strict=True):
            out[i] = result
    return out


class DecodedAhead:
    """A step's chunks [1, ..., T] decoded ahead (``decode_by_length``) for a loop that then decodes them one by one:
    ``take(codes)`` answers the next chunk's result where ``codes`` is that chunk (its shape and start in the step's
    flat storage: the loop slices the same ids), else None, and None for every chunk after a mismatch (the loop
    out of step: the rest decode alone). None also where the batch left the chunk (empty, or ``skip`` raised)."""

    def __init__(
        self, decode: Callable[[Tensor], Tensor], chunks: Sequence[Tensor], skip: tuple[type[Exception], ...] = ()
    ) -> None:
        self._pending = list(zip(chunks, decode_by_length(decode, chunks, skip), strict=True))

    def take(self, codes: Tensor) -> Tensor | None:
        chunk, result = self._pending.pop(0) if self._pending else (None, None)
        if chunk is not None and (chunk.shape, chunk.storage_offset()) != (codes.shape, codes.storage_offset()):
            self._pending, result = [], None
        return result


def check_waveform(waveform: Tensor | np.ndarray, sample_rate: int) -> Tensor:
    """A mono float32 tensor [N] from audio [N] or [channels, N]; ``TypeError`` / ``ValueError`` naming the problem."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int | np.integer):
        raise TypeError(f"sample_rate must be an integer number of Hz, got {sample_rate!r}")
    if not MIN_SAMPLE_RATE <= int(sample_rate) <= MAX_SAMPLE_RATE:
        raise ValueError(f"sample_rate {sample_rate} Hz is outside [{MIN_SAMPLE_RATE}, {MAX_SAMPLE_RATE}]")
    if isinstance(waveform, np.ndarray):
        if waveform.dtype.kind != "f":
            raise TypeError(f"audio samples must be floating point in [-1, 1], got dtype {waveform.dtype}")
        waveform = torch.from_numpy(np.ascontiguousarray(waveform))
    if not isinstance(waveform, Tensor):
        raise TypeError(f"audio must be a tensor or numpy array [samples] or [channels, samples], got "
                        f"{type(waveform).__name__}")  # fmt: skip
    if not waveform.dtype.is_floating_point:  # integer PCM would enter at 32768 times its level
        raise TypeError(f"audio samples must be floating point in [-1, 1], got dtype {waveform.dtype}")
    if waveform.dim() == 2:
        if waveform.shape[0] > 16:
            raise ValueError(
                f"audio of shape {list(waveform.shape)} has {waveform.shape[0]} channels; expected [channels, "
                "samples] with at most 16 channels (transpose a [samples, channels] array)"
            )
        waveform = waveform.float().mean(dim=0)  # mono by channel mean, as upstream
    elif waveform.dim() != 1:
        raise ValueError(f"audio must have shape [samples] or [channels, samples], got {list(waveform.shape)}")
    if waveform.numel() == 0:
        raise ValueError("audio is empty (0 samples)")
    waveform = waveform.float()
    if not bool(torch.isfinite(waveform).all()):
        bad = int((~torch.isfinite(waveform)).sum())
        raise ValueError(f"audio holds {bad} non-finite sample(s) (NaN/inf)")
    return waveform


def random_tensors(
    config, seed: int = 0, device: str | torch.device = "cpu", training_state: bool = True, encoder: bool = True
) -> dict[str, Tensor]:
    """Random codec weights in checkpoint (model) names, fp32; ``training_state`` adds the training-only tensors.

    Our own draw, not transformers' init (which zeroes the codebooks: every code would decode alike): convs and
    linears N(0, 1/fan_in), biases N(0, 0.02^2), Snake alphas in [0.5, 1.5], norms near 1, codebooks N(0, 1).
    The last conv is scaled so a random code sequence decodes to a peak of order 0.1-1. The tiny checkpoint is
    drawn with this: a change here needs a ``tiny.RECIPE_VERSION`` bump.
    """
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = expected_shapes(config, encoder)
    if training_state:
        shapes |= unused_shapes(config)
    out: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        out[name] = _random(name, shape, g, device)
    if training_state:
        s = spec_of(config)
        for i in range(s.num_quantizers):  # EMA statistics consistent with the codebook (sum = embed * count)
            p = f"quantizer.quantizers.{i}.codebook."
            out[p + "cluster_size"] = torch.ones(s.codebook_size, device=device)
            out[p + "embed_avg"] = out[p + "embed"].clone()
            out[p + "inited"] = torch.ones(1, device=device)
    return out


_OUTPUT_SCALE = 0.015


def _random(name: str, shape: tuple[int, ...], g: torch.Generator, device: torch.device) -> Tensor:
    def normal(std: float) -> Tensor:
        return torch.randn(shape, generator=g, device=device) * std

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "alpha":
        return 0.5 + torch.rand(shape, generator=g, device=device)
    if leaf == "embed":
        return normal(1.0)
    if leaf == "bias":
        return normal(0.02)
    if len(shape) == 1 or leaf == "original0":  # norm weights, and weight norm's per-tap gain
        return 1.0 + normal(0.05)
    if name.endswith("parametrizations.weight.original1"):  # weight norm's direction: only its angle matters
        return normal(1.0)
    # a transposed conv's output sums 2 taps of each input channel (kernel = 2 x stride)
    fan_in = shape[0] * 2 if "conv_t" in name else math.prod(shape[1:])
    std = fan_in**-0.5
    if ".res_unit" in name and leaf == "weight" and name.endswith("conv2.weight"):
        std *= 0.3  # a residual branch adding its input's variance at full scale would double it per unit
    if name == "acoustic_decoder.conv2.weight":
        std *= _OUTPUT_SCALE
    return normal(std)


def _check_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"codec device {device!r} is not supported (use 'cpu' or 'cuda')")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"codec device {device!r} requested but CUDA is not available on this machine")
    return dev


def _check_dtype(dtype: str | torch.dtype) -> torch.dtype:
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"codec dtype {dtype!r} is not supported; use float32 or bfloat16")
        return names[dtype]
    if dtype not in _DTYPES:
        raise ValueError(f"codec dtype {dtype} is not supported; use torch.float32 or torch.bfloat16")
    return dtype
