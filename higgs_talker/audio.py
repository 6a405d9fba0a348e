"""Audio glue between the talker and the codec: WAV files, a lazily loaded codec, reference audio -> codes (cached).

Nothing here imports the codec (transformers' DAC / HuBERT code) until a method needs it, so a talker that
never touches audio never pays for it.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import wave
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)

REFERENCE_SECONDS = (1.0, 30.0)  # upstream's server accepts reference audio of 1-30 s (SPEC_codec 5.1)
MAX_WAV_BYTES = 1 << 30
_PCM, _FLOAT, _EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
_CODEC_DTYPES = ("float32", "fp32", "bfloat16", "bf16", torch.float32, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# WAV files


def write_wav(path: str | Path, audio: Tensor | np.ndarray, sample_rate: int) -> Path:
    """Write mono audio [N] float as 16-bit PCM WAV, clipped to [-1, 1] (the only place audio is clipped)."""
    path = Path(path)
    pcm = pcm16(audio)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(pcm)
    return path


def pcm16(audio: Tensor | np.ndarray) -> bytes:
    """Mono audio [N] float -> 16-bit little-endian PCM bytes, clipped to [-1, 1] (what ``write_wav`` writes)."""
    samples = audio.detach().float().cpu().numpy() if isinstance(audio, Tensor) else np.asarray(audio, np.float32)
    if samples.ndim != 1:
        raise ValueError(f"write_wav takes mono audio [samples], got shape {list(samples.shape)}")
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """A WAV file -> (samples [channels, N] float32 in [-1, 1], sample rate).

    Reads PCM (8, 16, 24, 32 bit) and IEEE float (32, 64 bit), plain or WAVE_FORMAT_EXTENSIBLE; anything
    else is a ``ValueError`` naming the file. (Other containers: decode them yourself and pass the samples.)
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"audio file {str(path)!r} is a directory; give a WAV file")
    if not path.is_file():
        raise FileNotFoundError(f"audio file {str(path)!r} does not exist")
    if path.stat().st_size > MAX_WAV_BYTES:
        raise ValueError(f"{path} is larger than {MAX_WAV_BYTES >> 20} MiB; not read as reference audio")
    return decode_wav(path.read_bytes(), str(path))


def decode_wav(data: bytes, path: str = "audio") -> tuple[np.ndarray, int]:
    """The bytes of a WAV file -> (samples [channels, N] float32 in [-1, 1], sample rate), as ``read_wav``;
    ``path`` names the data in errors."""
    if len(data) > MAX_WAV_BYTES:
        raise ValueError(f"{path} is larger than {MAX_WAV_BYTES >> 20} MiB; not read as reference audio")
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError(f"{path} is not a WAV file (no RIFF/WAVE header); reference audio must be WAV")
    fmt, payload, pos = None, None, 12
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = data[pos + 8 : pos + 8 + size]  # a streamed file may claim more than it holds: take what is there
        if chunk == b"fmt ":
            fmt = body
        elif chunk == b"data":
            payload = body
        pos += 8 + size + (size & 1)
    if fmt is None or len(fmt) < 16 or payload is None:
        raise ValueError(f"{path} is not a valid WAV file: no {'fmt ' if fmt is None else 'data'} chunk")
    tag, channels, rate, _, align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack_from("<H", fmt, 24)[0]  # the sub-format GUID starts with the format tag
    if tag not in (_PCM, _FLOAT):
        raise ValueError(f"{path}: unsupported WAV encoding (format tag {tag:#06x}); use PCM or IEEE float")
    if channels < 1 or rate < 1 or align != channels * ((bits + 7) // 8):
        raise ValueError(f"{path}: inconsistent WAV header ({channels} channels, {rate} Hz, {bits} bit, align {align})")
    width = align // channels
    frames = len(payload) // align
    raw = np.frombuffer(payload[: frames * align], dtype=np.uint8).reshape(frames, channels, width)
    if tag == _PCM and bits == 8:
        samples = (raw[..., 0].astype(np.float32) - 128.0) / 128.0
    elif tag == _PCM and width in (2, 3, 4):
        # little-endian signed integers of `width` bytes, placed in the top bytes of an int32
        padded = np.zeros((frames, channels, 4), dtype=np.uint8)
        padded[..., 4 - width :] = raw
        samples = padded.view("<i4")[..., 0].astype(np.float32) / 2147483648.0
    elif tag == _FLOAT and width in (4, 8):
        samples = raw.copy().view("<f4" if width == 4 else "<f8")[..., 0].astype(np.float32)
    else:
        raise ValueError(f"{path}: unsupported WAV sample size ({bits} bit {'PCM' if tag == _PCM else 'float'})")
    return np.ascontiguousarray(samples.T), int(rate)


# ---------------------------------------------------------------------------------------------------------
# the codec of a talker, loaded on first use


def has_bundled_codec(path: str | Path) -> bool:
    """Whether a talker checkpoint carries codec keys (reads the safetensors headers only)."""
    from .checkpoint import CODEC_PREFIX, checkpoint_files, read_header

    return any(k.startswith(CODEC_PREFIX) for k in read_header(checkpoint_files(path)))


class CodecLoader:
    """The codec of a checkpoint directory, loaded on first use (thread-safe).

    Decoding uses the checkpoint's bundled codec, loaded decode-only. Encoding (reference audio) uses the
    audio tokenizer directory when one is given, as upstream does, else the bundled encoder; loading the
    bundled encoder replaces the decode-only codec (one copy of the shared tensors). With ``talker`` (a
    ``TalkerConfig``) each codec is checked to fit it: codes per frame, code range, sample and frame rate.
    """

    def __init__(
        self,
        path: str | Path,
        device: torch.device,
        dtype: str | torch.dtype = torch.float32,
        tokenizer_path: str | Path | None = None,
        talker=None,
        cache_size: int = 32,
    ) -> None:
        if dtype not in _CODEC_DTYPES:  # checked here: the codec itself is only imported on first use
            raise ValueError(f"codec dtype {dtype!r} is not supported; use float32 or bfloat16")
        self.path, self.device, self.dtype, self.talker = Path(path), device, dtype, talker
        self.tokenizer_path = None if tokenizer_path is None else Path(tokenizer_path)
        self._decoder = self._encoder = None
        self._lock = threading.Lock()
        self.cache = ReferenceCache(cache_size)

    def check_fit(self) -> None:
        """Check, from their configs alone (no weights read), that the codecs fit the talker: a codec that does not
        fails when the talker loads rather than at its first audio."""
        from .codec.config import spec_of
        from .codec.weights import find_source

        for path in dict.fromkeys(p for p in (self.path, self.tokenizer_path) if p is not None):
            source = find_source(path)
            if source is not None:
                self._check_fits(spec_of(source.config), path)

    def decoder(self):
        """The codec that decodes (``higgs_talker.codec.Codec``)."""
        with self._lock:
            if self._decoder is None:
                from .codec import Codec

                codec = Codec.from_pretrained(self.path, encoder=False, device=self.device, dtype=self.dtype)
                self._decoder = self._check_fits(codec, self.path)
            return self._decoder

    def encoder(self):
        """The codec that encodes reference audio."""
        with self._lock:
            if self._encoder is None:
                from .codec import Codec

                source = self.tokenizer_path or self.path
                codec = Codec.from_pretrained(source, encoder=True, device=self.device, dtype=self.dtype)
                self._encoder = self._check_fits(codec, source)
                if self.tokenizer_path is None:
                    self._decoder = self._encoder
            return self._encoder

    def _check_fits(self, codec, source: Path):  # a Codec, or the CodecSpec of one not yet loaded
        cfg = self.talker
        if cfg is None:
            return codec
        problems = [
            f"{what} {have} (talker: {want})"
            for what, have, want in (
                ("codes per frame", codec.num_quantizers, cfg.num_codebooks),
                ("codebook size", codec.codebook_size, cfg.num_real_codes),
                ("sample rate", codec.sample_rate, cfg.sample_rate),
                ("frame rate", codec.frame_rate, cfg.frame_rate),
            )
            if have != want
        ]
        if problems:
            raise ValueError(f"the codec of {source} does not fit the talker: {', '.join(problems)}")
        return codec

    def reference_codes(self, audio: str | Path | Tensor | np.ndarray, sample_rate: int | None) -> Tensor:
        """Reference audio (a WAV path, or samples with their rate) -> aligned codes [T, Q] int64, cached."""
        from .codec import check_waveform

        if isinstance(audio, str | Path):
            samples, sample_rate = read_wav(audio)
            wav = check_waveform(samples, sample_rate)
            where = str(audio)
        else:
            if sample_rate is None:
                raise ValueError("reference audio given as samples needs its sample_rate")
            wav = check_waveform(audio, sample_rate)
            where = "reference audio"
        seconds = wav.shape[0] / sample_rate
        lo, hi = REFERENCE_SECONDS
        if not lo <= seconds <= hi:
            raise ValueError(f"{where} lasts {seconds:.2f} s; reference audio must last {lo:g}-{hi:g} s")
        key = ReferenceCache.key(wav, sample_rate)
        codes = self.cache.get(key)
        if codes is None:
            codes = self.encoder().encode(wav, sample_rate)
            self.cache.put(key, codes)
        return codes


class ReferenceCache:
    """A small LRU of encoded references: sha1 over (rate, length, float32 samples) -> codes [T, Q]."""

    def __init__(self, size: int = 32) -> None:
        self.size, self._items, self._lock = size, OrderedDict(), threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def key(wav: Tensor, sample_rate: int) -> str:
        h = hashlib.sha1(f"{int(sample_rate)}:{wav.shape[0]}:".encode())
        h.update(wav.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def get(self, key: str) -> Tensor | None:
        with self._lock:
            codes = self._items.get(key)
            if codes is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return codes.clone()

    def put(self, key: str, codes: Tensor) -> None:
        with self._lock:
            self._items[key] = codes.clone()
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
