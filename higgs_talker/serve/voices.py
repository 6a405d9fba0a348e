"""Reference voices uploaded to the server: encoded once by the codec, kept as codes, named by ``voice``."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

from torch import Tensor

from ..results import Reference
from .protocol import APIError, VoiceCard

DEFAULT_VOICE = "default"  # the model's own voice: no reference in the prompt
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class Voice:
    name: str
    reference: Reference  # codes [frames, 8] and the words the recording says
    created_at: int

    def card(self, frame_rate: int) -> VoiceCard:
        frames = int(self.reference.codes.shape[0])
        return VoiceCard(
            name=self.name,
            ref_text=self.reference.text,
            frames=frames,
            seconds=frames / frame_rate,
            created_at=self.created_at,
        )


def check_voice_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise APIError(400, f"voice name {name!r:.80} must be 1-64 letters, digits, '_', '.' or '-'", "name")
    if name.lower() == DEFAULT_VOICE:
        raise APIError(400, f"voice name {name!r} is the model's own voice; choose another name", "name")
    return name


class VoiceStore:
    """Named voices (thread-safe), at most ``max_voices``; a name is taken until it is deleted. Names match in any
    case (``Alice`` and ``alice`` are one voice, as vllm-omni lower-cases them); a voice keeps the case it was
    uploaded with."""

    def __init__(self, max_voices: int = 64) -> None:
        self.max_voices = max_voices
        self._voices: dict[str, Voice] = {}
        self._lock = threading.Lock()

    def add(self, name: str, codes: Tensor, text: str | None) -> Voice:
        voice = Voice(check_voice_name(name), Reference(codes=codes, text=text), int(time.time()))
        with self._lock:
            if name.lower() in self._voices:
                raise APIError(
                    409, f"a voice named {name!r} exists; delete it first (DELETE /v1/audio/voices/{name})", "name"
                )
            if len(self._voices) >= self.max_voices:
                raise APIError(400, f"the server holds {self.max_voices} voices, its most; delete one first", "name")
            self._voices[name.lower()] = voice
        return voice

    def get(self, name: str) -> Voice | None:
        with self._lock:
            return self._voices.get(name.lower())

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._voices.pop(name.lower(), None) is not None

    def all(self) -> list[Voice]:
        with self._lock:
            return sorted(self._voices.values(), key=lambda v: v.name)
