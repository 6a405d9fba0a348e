"""A request that waits in the engine's queue (every decode slot taken) when its client leaves: over HTTP, its
engine request goes at once (``stream_audio`` checks the cancel event after every engine step, not only at a
frame, which a queued request does not make; ``tests/test_split.py`` checks that in the Python API)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from _engine_invariants import remember_idle
from test_serve import running, wait_until_idle

from higgs_talker import HiggsTalker
from higgs_talker.serve.serving import ServeConfig, SpeechServing


def test_a_queued_request_whose_client_left_leaves_the_engine(tiny_dir) -> None:
    talker = remember_idle(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=2, max_model_len=1024))
    serving = SpeechServing(talker, ServeConfig(model_name="tiny"))
    engine, stop = talker.engine, threading.Event()
    text = " ".join(f"Sentence {i} keeps the greedy talker going for a while." for i in range(12))
    body = {"input": text, "temperature": 0.0, "max_new_tokens": 2000, "response_format": "pcm"}
    with running(serving) as url:

        def hold_a_slot() -> None:
            with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=60) as response:
                for _ in response.iter_raw():
                    if stop.is_set():
                        return

        holders = [threading.Thread(target=hold_a_slot) for _ in range(2)]
        try:
            for t in holders:
                t.start()
            while len(engine.scheduler.running) < 2:
                time.sleep(0.02)
            with pytest.raises(httpx.ReadTimeout):  # queued behind both: no first byte before the client leaves
                httpx.post(url + "/v1/audio/speech", json=body | {"input": "A short one.", "seed": 4242}, timeout=1.0)
            left = [r for r, req in list(engine.requests.items()) if req.seed == 4242]  # its request, by its seed
            deadline = time.monotonic() + 2.0
            while any(r in engine.requests for r in left) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert left and not any(r in engine.requests for r in left), "the request stayed queued"
        finally:
            stop.set()
            for t in holders:
                t.join(timeout=60)
    wait_until_idle(serving)
