"""Audio bytes on the wire: 16-bit PCM, WAV headers (exact, or a streaming one whose sizes are unknown),
server-sent events, and the compressed formats of OpenAI's speech API (mp3, opus, aac, flac), encoded by FFmpeg
through PyAV (the ``serve`` extra) as the audio comes."""

from __future__ import annotations

import base64
import io
import struct

from pydantic import BaseModel

# format -> (FFmpeg muxer, encoder, media type): containers that can be written front to back as the audio comes
ENCODED = {
    "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
    "opus": ("ogg", "libopus", "audio/ogg"),
    "aac": ("adts", "aac", "audio/aac"),
    "flac": ("flac", "flac", "audio/flac"),
}
# LAME's own choice for 24 kHz mono is 32 kb/s (about 19 dB SNR on a harmonic test tone); the others pick ~60-80
BIT_RATES = {"mp3": 64_000}
FORMATS = ("wav", "pcm", *ENCODED)  # OpenAI's six: the two written here, then the encoded ones in OpenAI's order
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"} | {name: media for name, (_, _, media) in ENCODED.items()}
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


class AudioEncoder:
    """16-bit mono PCM in, one of ``ENCODED``'s formats out: ``encode(pcm)`` returns the bytes that chunk completed
    (often none: an encoder holds back a frame's worth), ``finish()`` the rest, once. The container is written to a
    sink without seeking, so the bytes can be sent as they come (a FLAC stream's header then gives no length, an
    MP3 no record of the encoder's delay). Given a seekable ``file``, it is written there instead (``encode`` and
    ``finish`` return nothing): the muxer then goes back to fill in those headers."""

    def __init__(self, fmt: str, sample_rate: int, file: io.BytesIO | None = None) -> None:
        import av  # the serve extra; only a request for a compressed format needs it

        muxer, codec, _ = ENCODED[fmt]
        self._av, self._rate, self._pts, self._out = av, sample_rate, 0, bytearray()
        self._container = av.open(_Sink(self._out) if file is None else file, "w", format=muxer)
        self._stream = self._container.add_stream(codec, rate=sample_rate, layout="mono")
        if fmt in BIT_RATES:
            self._stream.bit_rate = BIT_RATES[fmt]
        # each encoder takes its own sample format (s16p, fltp, ...): converted from s16, same rate and layout
        self._resampler = av.AudioResampler(format=self._stream.codec_context.format.name, layout="mono",
                                            rate=sample_rate)  # fmt: skip

    def encode(self, pcm: bytes) -> bytes:
        if pcm:
            frame = self._av.AudioFrame(format="s16", layout="mono", samples=len(pcm) // 2)
            frame.planes[0].update(pcm)
            frame.sample_rate, frame.pts = self._rate, self._pts
            self._pts += frame.samples
            self._encode(self._resampler.resample(frame))
        return self._take()

    def finish(self) -> bytes:
        self._encode(self._resampler.resample(None))
        self._encode([None])  # flushes the encoder
        self._container.close()  # the trailer
        return self._take()

    def _encode(self, frames) -> None:
        for frame in frames:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)

    def _take(self) -> bytes:
        data = bytes(self._out)
        self._out.clear()
        return data


def encode_whole(fmt: str, sample_rate: int, pcm: bytes) -> bytes:
    """A whole recording of 16-bit mono PCM as one file of ``fmt`` (one of ``ENCODED``), its headers complete (a
    FLAC's length, an MP3's encoder delay and padding, so that it decodes to exactly the samples given)."""
    file = io.BytesIO()
    encoder = AudioEncoder(fmt, sample_rate, file)
    encoder.encode(pcm)
    encoder.finish()
    return file.getvalue()


class _Sink:
    """A write-only, unseekable file for FFmpeg's muxer: what it writes is appended to ``out``."""

    def __init__(self, out: bytearray) -> None:
        self._out = out

    def write(self, data) -> int:
        self._out += data
        return len(data)
