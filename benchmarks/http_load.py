"""One streamed speech request over HTTP, timed: what the HTTP load generators of ``bench_serve.py`` and
``bench_omni.py`` share. Imports nothing heavy (no torch), so a load-generator process stays light."""

from __future__ import annotations

import time


async def stream_speech(client, body: dict, path: str = "/v1/audio/speech") -> tuple[float, float | None, float, int]:
    """POST ``body`` with ``client`` (an ``httpx.AsyncClient``) and read the streamed reply to its end.

    Returns (sent, first audio byte or None, end) as ``time.perf_counter()`` values and the bytes received; a reply
    other than 200 raises ``RuntimeError`` with its status and the start of its body."""
    sent, first, size = time.perf_counter(), None, 0
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        async for chunk in response.aiter_raw():
            if chunk and first is None:
                first = time.perf_counter()
            size += len(chunk)
    return sent, first, time.perf_counter(), size
