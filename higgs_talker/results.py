"""What a generation returns: ``GenerationResult`` (codes, rows, timings, the seed used, audio through the
codec), the ``Reference`` voice a prompt clones, ``GenerationError`` and ``GenerationCancelled``."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import Tensor

from .audio import CodecLoader, write_wav
from .heads.delay import revert_delay_pattern


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A new temporary file beside ``path`` (its suffix in lower case) that replaces ``path`` when the block
    completes and is removed if it fails or is interrupted: ``path`` is never left half-written. A symlink is
    written through. (Lower case: ``np.save`` appends ``.npy`` to a name that does not end in ``.npy`` exactly,
    so ``codes.NPY`` would have been written to a file beside the temporary one, and an empty file renamed.)"""
    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.partial{target.suffix.lower()}")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # O_EXCL: never someone else's file
    except OSError as exc:  # name the file the caller asked for, not our temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class GenerationError(RuntimeError):
    """A request failed inside a step (its cause is ``__cause__``); other requests are unaffected."""


class GenerationCancelled(Exception):
    """A stream stopped because its caller set its cancel event (``HiggsTalker.stream_audio(cancel=...)``); its
    requests were cancelled, and their decode slots and KV blocks freed, before this was raised."""


@dataclass(frozen=True)
class Reference:
    """A reference voice for cloning: aligned codec codes [T, C], or audio the codec encodes; optionally its words.

    ``audio`` is a WAV path, or samples [N] / [channels, N] with their ``sample_rate``; 1-30 s, mixed to mono
    and resampled to 24 kHz as upstream does. Encoded references are cached per talker.
    """

    codes: Tensor | np.ndarray | None = None
    text: str | None = None
    audio: str | Path | Tensor | np.ndarray | None = None
    sample_rate: int | None = None

    def __post_init__(self) -> None:
        if (self.codes is None) == (self.audio is None):
            raise ValueError("a Reference needs exactly one of codes= (aligned codes [T, C]) or audio= (WAV, samples)")
        if isinstance(self.audio, str | Path) and self.sample_rate is not None:
            raise ValueError("Reference.sample_rate is for audio samples; a WAV file gives its own rate")
        if self.audio is not None and not isinstance(self.audio, str | Path) and self.sample_rate is None:
            raise ValueError("Reference(audio=samples) needs sample_rate=")


@dataclass
class GenerationResult:
    """Codes of one request and how long they took."""

    request_id: str
    text: str
    codes: Tensor  # [F, C] int64: aligned frames as the codec receives them (SPEC 8.2)
    rows: Tensor  # [R, C] int64: the delayed rows as generated (BOC/EOC included)
    finish_reason: str
    seed: int  # the sampling seed used (the given one, or the one drawn): reproduces this result
    prompt_tokens: int
    prefill_ms: float
    decode_ms: float
    frame_rate: int
    sample_rate: int | None = None  # Hz of ``audio``; None when the talker has no codec
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (``prefix_caching=True``)
    codec: CodecLoader | None = field(default=None, repr=False, compare=False)
    parts: list[GenerationResult] = field(default_factory=list, repr=False, compare=False)  # split=: each part's
    _audio: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def audio(self) -> Tensor | None:
        """[F * hop] float32 (CPU) at ``sample_rate``: ``codes`` decoded on first access; None without a codec."""
        if self._audio is None and self.codec is not None:
            self._audio = self.codec.decoder().decode(self.codes).cpu()
        return self._audio

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def num_frames(self) -> int:
        return int(self.codes.shape[0])

    @property
    def audio_seconds(self) -> float:
        return self.num_frames / self.frame_rate

    @property
    def ms_per_step(self) -> float:
        return self.decode_ms / max(self.num_rows - 1, 1)

    @property
    def rtf(self) -> float:
        """Real-time factor: generation time over audio duration (below 1 is faster than real time)."""
        total = (self.prefill_ms + self.decode_ms) / 1e3
        return total / self.audio_seconds if self.audio_seconds else float("inf")

    def aligned(self) -> Tensor:
        """All reverted frames [R - C + 1, C] with BOC/EOC kept (nothing trimmed)."""
        return revert_delay_pattern(self.rows)

    def save(self, path: str | Path) -> Path:
        """Write ``audio`` to ``.wav`` (24 kHz mono 16-bit), ``codes`` to ``.npy``, or both codes and rows to
        ``.safetensors`` (the suffix in any case). The file appears complete or not at all: it is written beside
        ``path`` under a temporary name and renamed."""
        path = Path(path)
        kind = path.suffix.lower()
        if kind == ".wav" and self.audio is None:
            raise ValueError(f"cannot write {str(path)!r}: this result has no audio (the talker has no codec)")
        if kind not in (".wav", ".npy", ".safetensors"):
            raise ValueError(f"unsupported output format {path.suffix!r}: use .wav, .npy or .safetensors")
        with _replacing(path) as tmp:
            if kind == ".wav":
                write_wav(tmp, self.audio, self.sample_rate)
            elif kind == ".npy":
                np.save(tmp, self.codes.numpy())
            else:  # serialized here: save_file writes a temporary file of its own, mode 0600 whatever the umask
                from safetensors.torch import save

                tmp.write_bytes(
                    save(
                        {"codes": self.codes.contiguous(), "rows": self.rows.contiguous()},
                        metadata={"text": self.text, "frame_rate": str(self.frame_rate), "seed": str(self.seed)},
                    )
                )
        return path

    def summary(self) -> str:
        return (
            f"{self.num_frames} frames, {self.audio_seconds:.2f} s audio, {self.num_rows} steps "
            f"({self.finish_reason}), seed {self.seed}, prefill {self.prefill_ms:.1f} ms, "
            f"{self.ms_per_step:.2f} ms/step, RTF {self.rtf:.3f}"
        )
