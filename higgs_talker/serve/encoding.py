"""Audio bytes on the wire: 16-bit PCM, WAV headers (exact, or a streaming one whose sizes are unknown) and
server-sent events. Pure functions."""

from __future__ import annotations

import base64
import struct

from pydantic import BaseModel

FORMATS = ("wav", "pcm")  # what the server writes; anything else needs an encoder library (a 400 says so)
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
UNKNOWN_SIZE = 0xFFFFFFFF  # RIFF and data sizes of a streamed WAV: readers take the data up to the end


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """The 44-byte header of a 16-bit mono PCM WAV with ``data_bytes`` of samples (None: a stream, size unknown)."""
    data = UNKNOWN_SIZE if data_bytes is None else data_bytes
    riff = UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF" + struct.pack("<I", riff) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data" + struct.pack("<I", data)
    )  # fmt: skip


def sse_event(event: BaseModel) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return b"data: " + event.model_dump_json().encode() + b"\n\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
