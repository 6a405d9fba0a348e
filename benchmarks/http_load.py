"""One streamed speech request over HTTP, timed: what the HTTP load generators of ``bench_serve.py`` and
``bench_omni.py`` share. Imports nothing heavy (no torch), so a load-generator process stays light."""

from __future__ import annotations

import time


class Playback:
    """A player that starts with the first audio to arrive and then plays without pausing: ``arrive(now, seconds)``
    for each piece of audio as it comes; ``stall_s`` is how long it sat waiting for audio after it started (the
    gaps a listener hears), ``stalls`` how many times."""

    def __init__(self) -> None:
        self.until: float | None = None  # when the audio received so far ends playing
        self.stall_s, self.stalls = 0.0, 0

    def arrive(self, now: float, seconds: float) -> None:
        if self.until is not None and now > self.until:
            self.stall_s, self.stalls = self.stall_s + now - self.until, self.stalls + 1
        self.until = max(now, self.until if self.until is not None else now) + seconds


async def stream_speech(
    client, body: dict, path: str = "/v1/audio/speech", bytes_per_second: float | None = None
) -> tuple[float, float | None, float, int, float | None]:
    """POST ``body`` with ``client`` (an ``httpx.AsyncClient``) and read the streamed reply to its end.

    Returns (sent, first audio byte or None, end) as ``time.perf_counter()`` values, the bytes received and, given
    the audio's ``bytes_per_second`` (raw PCM), the seconds a player starting at the first byte waits for audio
    (``Playback``; else None); a reply other than 200 raises ``RuntimeError`` with its status and the start of its
    body."""
    sent, first, size, player = time.perf_counter(), None, 0, Playback()
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        async for chunk in response.aiter_raw():
            now = time.perf_counter()
            if chunk and first is None:
                first = now
            size += len(chunk)
            if chunk and bytes_per_second:
                player.arrive(now, len(chunk) / bytes_per_second)
    return sent, first, time.perf_counter(), size, player.stall_s if bytes_per_second else None
