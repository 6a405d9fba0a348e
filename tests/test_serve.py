"""The speech server over real HTTP: uvicorn on an ephemeral 127.0.0.1 port, the tiny checkpoint on CPU.

Clients are the ``openai`` package (``audio.speech.create`` and its streaming response) and ``httpx`` (raw chunks,
server-sent events, multipart voice uploads). Audio is compared with what the Python API makes for the same seeded
request on a talker of its own: exactly, or, where batching moved a code, through a proven floating-point near tie
(``explain_divergence``, as the concurrency tests do) and then exactly against the batched codes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx  # the dev extra installs the server and both clients: a missing one fails here, loudly
import openai
import pytest
import torch
from _engine_invariants import assert_idle, explain_divergence, remember_idle

from higgs_talker import HiggsTalker, Reference, SamplingParams
from higgs_talker.audio import decode_wav, pcm16, write_wav
from higgs_talker.heads.delay import codec_frames
from higgs_talker.results import GenerationError
from higgs_talker.serve.app import make_server
from higgs_talker.serve.protocol import SpeechRequest
from higgs_talker.serve.serving import ServeConfig, SpeechServing
from higgs_talker.splitting import frame_budget

PART_CHARS = 150
CONFIG = ServeConfig(
    model_name="tiny", max_input_chars=6000, max_body_bytes=1 << 20, max_new_tokens=2048, part_chars=PART_CHARS
)
TIMEOUT = httpx.Timeout(60.0)
# what a request that names no sampling gets (the deploy profiles', as vllm-omni's endpoint)
SERVED = dict(temperature=CONFIG.temperature, top_p=CONFIG.top_p, top_k=CONFIG.top_k)


@contextlib.contextmanager
def running(serving: SpeechServing):
    """uvicorn serving ``serving`` on a free 127.0.0.1 port in a thread; yields the base URL, stops on exit."""
    server, sock = make_server(serving, "127.0.0.1", 0, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        assert server.started, "uvicorn did not start"
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="module")
def served(tiny_dir):
    talker = remember_idle(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024))
    serving = SpeechServing(talker, CONFIG)
    with running(serving) as url:
        yield serving, url


@pytest.fixture(scope="module")
def solo(tiny_dir) -> HiggsTalker:
    return HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=1, max_model_len=1024)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="none", max_retries=0, timeout=60)


def speech(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/audio/speech", json=body, timeout=TIMEOUT)


def expected_pcm(solo: HiggsTalker, text: str, params: SamplingParams, reference=None) -> bytes:
    """What the server must send: the API's streamed audio for the same request (same parts, same decoder cuts)."""
    return pcm16(torch.cat(list(solo.stream_audio(text, params, reference, split=PART_CHARS))))


def pcm_of_codes(talker: HiggsTalker, codes: torch.Tensor) -> bytes:
    """Aligned codes [F, 8] through a streaming decoder one frame at a time, as the server decodes them."""
    decoder, out = talker.codec.stream(), []
    for frame in codes:
        chunk = decoder.push(frame)
        if chunk is not None:
            out.append(chunk.cpu())
    last = decoder.finish()
    if last is not None:
        out.append(last.cpu())
    return pcm16(torch.cat(out)) if out else b""


def assert_same_pcm(got: bytes, want: bytes, what: str) -> None:
    """16-bit PCM equal to at most one step per sample: concurrent streams share their codec decodes
    (``WindowBatcher``), and a window decoded in a batch rounds otherwise than alone (float rounding, which can
    move a sample across a 16-bit step); another request's audio, or the same one shifted, differs by far more."""
    assert len(got) == len(want), f"{what}: {len(got)} bytes, expected {len(want)}"
    a = torch.frombuffer(bytearray(got), dtype=torch.int16).int()
    b = torch.frombuffer(bytearray(want), dtype=torch.int16).int()
    worst = int((a - b).abs().max()) if len(a) else 0
    assert worst <= 1, f"{what}: samples differ by up to {worst} 16-bit steps"


def wav_data(body: bytes) -> bytes:
    """The samples of a 16-bit mono 24 kHz WAV body (after checking its header)."""
    samples, rate = decode_wav(body)
    assert rate == 24000 and samples.shape[0] == 1 and body[20:24] == b"\x01\x00\x01\x00"
    return body[44:]


def check_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    # OpenAI's code: a string naming the error, or null; never the status (a number breaks typed clients)
    assert error["code"] is None or isinstance(error["code"], str), error
    assert error["param"] == param, error
    assert error["message"]
    return error


def speech_workers() -> list[threading.Thread]:
    """The server's worker threads still running (each is named after its request, ``speech-N``)."""
    return [t for t in threading.enumerate() if t.name.startswith("speech-")]


def wait_until_idle(serving: SpeechServing, timeout: float = 20.0) -> None:
    """No request live in the server or the engine, and every worker has ended (and counted how its request did:
    a cancelled one frees its slot first, then counts)."""
    deadline = time.monotonic() + timeout
    engine = serving.talker.engine
    while serving.active_requests or engine.requests or engine.scheduler._unpublished or speech_workers():
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.02)
    assert_idle(serving.talker)


# ---------------------------------------------------------------------------------------------------------


def test_importing_the_package_imports_no_server_library() -> None:
    code = (
        "import sys, higgs_talker, higgs_talker.cli, higgs_talker.serve, higgs_talker.serve.options\n"
        "higgs_talker.cli._build_parser()\n"
        "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'multipart', 'python_multipart') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})


def test_listings(served) -> None:
    serving, url = served
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert httpx.head(url + "/health").status_code == 200  # load balancers' probes
    wrong = httpx.get(url + "/v1/audio/speech")  # a 405 names the methods the path takes, in the one error shape
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST", wrong.headers
    assert wrong.json()["error"]["message"] == "Method Not Allowed"
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 1024
    voices = httpx.get(url + "/v1/audio/voices").json()
    assert voices["object"] == "list" and voices["data"][0]["name"] == "default"


def test_the_openai_client_lists_and_retrieves_the_model(client) -> None:
    """``client.models.retrieve`` is ``GET /v1/models/{id}``: the served model's card, 404 for another."""
    assert [m.id for m in client.models.list()] == ["tiny"]
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model" and card.owned_by == "higgs-talker"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("tts-1")
    assert exc.value.body["code"] == "model_not_found" and exc.value.param == "model"


def test_openai_client_gets_the_audio_of_the_api(served, solo, client) -> None:
    serving, _ = served
    text, params = "Hello from the openai client.", SamplingParams(**SERVED, seed=11, max_frames=40)
    want = expected_pcm(solo, text, params)
    got = client.audio.speech.create(model="tiny", voice="default", input=text, response_format="wav",
                                     extra_body={"seed": 11, "max_new_tokens": 40})  # fmt: skip
    assert wav_data(got.content) == want and len(want) > 0
    with client.audio.speech.with_streaming_response.create(
        model="tiny", voice="default", input=text, response_format="pcm", extra_body={"seed": 11, "max_new_tokens": 40}
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        assert b"".join(response.iter_bytes()) == want
    mp3 = client.audio.speech.create(model="tiny", voice="default", input=text, response_format="mp3",
                                     extra_body={"seed": 11, "max_new_tokens": 40})  # fmt: skip
    samples = torch.frombuffer(bytearray(want), dtype=torch.int16).float()
    assert mp3.response.headers["content-type"] == "audio/mpeg"
    assert best_correlation(decoded(mp3.content), samples) >= 0.9  # OpenAI's own default format, through its client
    whole = speech(served[1], input=text, seed=11, max_new_tokens=40, stream=False)
    assert int(whole.headers["content-length"]) == 44 + len(want)
    samples, _ = decode_wav(whole.content)
    assert samples.shape[1] == len(want) // 2  # the exact header's sizes
    wait_until_idle(serving)


def decoded(body: bytes) -> torch.Tensor:
    """A compressed body decoded by FFmpeg (PyAV, an independent reader of the container), as 16-bit mono 24 kHz
    samples (Opus decodes at 48 kHz: resampled)."""
    import io

    import av

    resampler = av.AudioResampler(format="s16", layout="mono", rate=24000)
    with av.open(io.BytesIO(body)) as container:
        frames = [f for frame in container.decode(audio=0) for f in resampler.resample(frame)]
    frames += resampler.resample(None)
    return torch.cat([torch.from_numpy(f.to_ndarray().reshape(-1).copy()) for f in frames]).float()


def header_samples(body: bytes) -> int | None:
    """The length a compressed file's headers give, in samples at 24 kHz (None: they give none)."""
    import io

    import av

    with av.open(io.BytesIO(body)) as container:
        stream = container.streams.audio[0]
        return None if stream.duration is None else round(stream.duration * stream.time_base * 24000)


def best_correlation(got: torch.Tensor, want: torch.Tensor, max_lag: int = 2048, band_hz: float = 2000.0) -> float:
    """The normalized correlation of ``want`` with ``got`` from 100 Hz to ``band_hz`` (what every codec here keeps;
    MP3 and Opus drop the top of the tiny model's broadband audio) at the best delay in [0, max_lag] samples (an
    encoder's priming delays what it decodes to)."""

    def low(x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x.double())
        spectrum[int(band_hz / 24000 * x.numel()) :] = 0
        spectrum[: int(100 / 24000 * x.numel()) + 1] = 0  # and above 100 Hz: Opus removes what lies below
        return torch.fft.irfft(spectrum, n=x.numel())

    n = want.numel()
    got, want = low(got), low(want)
    lags = range(0, min(max_lag, got.numel() - n) + 1)
    return max(float(torch.nn.functional.cosine_similarity(got[lag : lag + n], want, dim=0)) for lag in lags)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
def test_compressed_formats_carry_the_audio_whole_and_streamed(served, solo, fmt) -> None:
    """OpenAI's compressed formats: the whole file (stream false) and the streamed bytes each decode (FFmpeg) to the
    API's audio: FLAC to the very samples; the lossy codecs to at least its length plus their priming and padding,
    correlated >= 0.9 with it from 100 Hz to 2 kHz at their delay (0.95-0.99 seen; another request's audio
    correlates 0.15-0.16 so, at its best delay). A whole FLAC's header gives its length and a whole MP3 decodes
    to exactly the API's length (the encoder's delay and padding recorded)."""
    _, url = served
    text, params = "Compressed as it comes.", SamplingParams(seed=5, temperature=0.0, max_frames=60)
    want = torch.frombuffer(bytearray(expected_pcm(solo, text, params)), dtype=torch.int16).float()
    body = {"input": text, "seed": 5, "temperature": 0.0, "max_new_tokens": 60, "response_format": fmt}
    media = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac"}[fmt]
    whole = speech(url, **body, stream=False)
    assert whole.status_code == 200 and whole.headers["content-type"] == media, whole.text
    with httpx.stream("POST", url + "/v1/audio/speech", json=body | {"stream_format": "audio"}, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"] == media
        chunks = [c for c in r.iter_raw() if c]
    assert len(chunks) >= 2, "the encoded audio came in one piece"
    for what, data in (("whole", whole.content), ("streamed", b"".join(chunks))):
        got = decoded(data)
        if fmt == "flac":  # lossless: the samples themselves
            assert torch.equal(got, want), what
            continue
        if what == "whole" and fmt == "mp3":  # the LAME header gives the encoder's delay and padding: cut exactly
            assert got.numel() == want.numel() == header_samples(data), (got.numel(), want.numel())
        assert want.numel() <= got.numel() <= want.numel() + 4096, (what, got.numel(), want.numel())
        assert best_correlation(got, want) >= 0.9, what
    if fmt == "flac":  # a whole file's STREAMINFO holds its length (a stream's cannot: it is sent before the audio)
        assert header_samples(whole.content) == want.numel()


def test_a_streams_encoder_does_not_hold_up_the_other_clients(served, monkeypatch) -> None:
    """An MP3 stream's encoder, held inside its ``encode``, leaves the server answering everyone else (with it on
    the event loop, /health would wait for it); the stream then completes."""
    from higgs_talker.serve import encoding

    _, url = served
    entered, release, real = threading.Event(), threading.Event(), encoding.AudioEncoder.encode

    def held(self, pcm):
        entered.set()
        release.wait(60)
        return real(self, pcm)

    monkeypatch.setattr(encoding.AudioEncoder, "encode", held)
    streamed: dict = {}

    def stream():
        body = {"input": "Held in the encoder.", "seed": 3, "max_new_tokens": 20, "response_format": "mp3"}
        response = speech(url, **body)
        streamed.update(status=response.status_code, size=len(response.content))

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert entered.wait(60), "the stream never reached its encoder"
        health = httpx.get(url + "/health", timeout=10)
    finally:
        release.set()
        thread.join(60)
    assert health.status_code == 200 and health.json()["active_requests"] == 1
    assert streamed["status"] == 200 and streamed["size"] > 0


def test_a_request_without_sampling_gets_the_deploy_profiles(served, solo) -> None:
    """No temperature / top_p / top_k: the deploy profiles' 1.0 / 0.95 / 50, as vllm-omni's speech endpoint
    samples (its deploy YAMLs); each field a request gives overrides its own."""
    _, url = served
    assert SERVED == {"temperature": 1.0, "top_p": 0.95, "top_k": 50}
    text = "Sampled as deployed."
    deployed = expected_pcm(solo, text, SamplingParams(**SERVED, seed=13, max_frames=30))
    unfiltered = expected_pcm(solo, text, SamplingParams(seed=13, max_frames=30))
    assert deployed != unfiltered  # the filter changes this request's draws: the check can tell them apart
    body = {"input": text, "seed": 13, "max_new_tokens": 30, "response_format": "pcm", "stream": False}
    assert speech(url, **body).content == deployed
    assert speech(url, **body, top_p=1.0, top_k=-1).content == unfiltered
    assert speech(url, **body, extra_params={"top_p": 1.0, "top_k": -1}).content == unfiltered  # vllm-omni's way


def test_streamed_bytes_arrive_chunk_by_chunk(served, solo) -> None:
    """Raw chunks: the first is the decoder's first chunk (1 frame), sent before the request is done."""
    _, url = served
    text, params = "Streaming as frames complete.", SamplingParams(seed=5, temperature=0.0, max_frames=80)
    want = expected_pcm(solo, text, params)
    # stream_format "audio" with stream true: how a vllm-omni client asks for the raw bytes
    body = {"input": text, "seed": 5, "temperature": 0.0, "max_new_tokens": 80, "response_format": "wav",
            "stream": True, "stream_format": "audio"}  # fmt: skip
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
        chunks = list(response.iter_raw())
    hop = 960 * 2  # one frame of 16-bit samples
    assert len(chunks[0]) == 44 + hop, [len(c) for c in chunks]  # the streaming header, then the first frame
    assert len(chunks) >= 3
    data = b"".join(chunks)
    assert data[:4] == b"RIFF" and data[40:44] == b"\xff\xff\xff\xff"  # data size unknown while streaming
    assert wav_data(data) == want


@pytest.mark.parametrize(("chunking", "first_frames"), [("upstream", 1), ("fast-start", 3)])
def test_a_server_streams_with_the_chunking_it_was_started_with(solo, chunking, first_frames) -> None:
    """``--chunking``: the first raw chunk holds the rule's first frames, and the audio is the API's streamed
    audio under the same rule (neither rule is exact: each differs from the default's audio)."""
    from higgs_talker.serve.serving import CHUNKINGS

    text, params = "Cut as the server was told.", SamplingParams(seed=9, temperature=0.0, max_frames=80)
    want = pcm16(torch.cat(list(solo.stream_audio(text, params, chunking=CHUNKINGS[chunking], split=PART_CHARS))))
    assert want != expected_pcm(solo, text, params)
    serving = SpeechServing(solo, dataclasses.replace(CONFIG, chunking=chunking))
    body = {"input": text, "seed": 9, "temperature": 0.0, "max_new_tokens": 80, "response_format": "pcm",
            "stream_format": "audio"}  # fmt: skip
    with running(serving) as url, httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        chunks = list(r.iter_raw())
    assert len(chunks[0]) == first_frames * 960 * 2 and b"".join(chunks) == want


@pytest.mark.parametrize("select", [{"stream_format": "sse"}, {"stream": True}], ids=["stream_format", "stream"])
def test_sse_events(served, solo, select) -> None:
    """OpenAI's ``stream_format: sse``, and vllm-omni's ``stream: true`` without a stream_format (events there)."""
    _, url = served
    text, params = "Events, please.", SamplingParams(seed=9, temperature=0.0, max_frames=50)
    want = expected_pcm(solo, text, params)
    body = {"input": text, "seed": 9, "temperature": 0.0, "max_new_tokens": 50, "response_format": "pcm", **select}
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=TIMEOUT) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) >= 3
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == want
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    assert done["usage"]["output_tokens"] == len(want) // (960 * 2)
    assert done["usage"]["input_tokens"] == len(solo.build_prompt(text))
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + done["usage"]["output_tokens"]


def test_flac_events_carry_the_samples_and_a_server_without_pyav_says_what_it_needs(served, solo, monkeypatch) -> None:
    """SSE with an encoded format: the deltas, joined, are one FLAC stream of the API's samples (its end sent with
    the last delta, before the done event). Without PyAV, a compressed format is a 400 naming response_format
    that says what to install, and wav still works."""
    import importlib.util

    _, url = served
    text, params = "Events, please.", SamplingParams(seed=9, temperature=0.0, max_frames=50)
    want = torch.frombuffer(bytearray(expected_pcm(solo, text, params)), dtype=torch.int16).float()
    body = {"input": text, "seed": 9, "temperature": 0.0, "max_new_tokens": 50, "response_format": "flac",
            "stream_format": "sse"}  # fmt: skip
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=TIMEOUT) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * (len(events) - 1) + ["speech.audio.done"]
    assert torch.equal(decoded(b"".join(base64.b64decode(e["audio"]) for e in events[:-1])), want)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "av" else real(name, *a))
    error = check_error(speech(url, input="Hi.", response_format="mp3"), 400, "response_format")
    assert "PyAV" in error["message"] and "serve" in error["message"]
    assert speech(url, input="Hi.", max_new_tokens=5, response_format="wav").status_code == 200


def test_eight_concurrent_clients_get_their_own_audio(served, solo, monkeypatch) -> None:
    """Each of 8 clients at once gets the audio of its codes, and its codes are those of the request alone (or
    differ from them only by a proven near-tie flip)."""
    serving, url = served
    finished: dict[tuple, torch.Tensor] = {}
    real_pop = serving.talker.engine.pop_finished

    def pop_finished(request_id):
        req = real_pop(request_id)
        finished[tuple(req.prompt.input_ids.tolist())] = torch.stack(req.rows).long()
        return req

    monkeypatch.setattr(serving.talker.engine, "pop_finished", pop_finished)
    texts = [f"Client number {i} speaks{'.' * (i % 3 + 1)}" for i in range(8)]
    bodies = [{"input": t, "seed": 100 + i, "temperature": [1.0, 0.7, 0.0][i % 3], "top_k": [-1, 30][i % 2],
               "max_new_tokens": 30 + 5 * i, "response_format": ["pcm", "wav"][i % 2],
               "stream_format": ["audio", "sse"][i // 4]} for i, t in enumerate(texts)]  # fmt: skip
    barrier, answers, errors = threading.Barrier(8), [None] * 8, []

    def call(i):
        try:
            barrier.wait()
            answers[i] = speech(url, **bodies[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(not t.is_alive() for t in threads), errors
    for i, (text, body, answer) in enumerate(zip(texts, bodies, answers, strict=True)):
        assert answer.status_code == 200, answer.text
        if body["stream_format"] == "sse":
            events = [json.loads(x[6:]) for x in answer.text.splitlines() if x.startswith("data: ")]
            data = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        else:
            data = answer.content
        data = wav_data(data) if body["response_format"] == "wav" else data
        params = SamplingParams(seed=body["seed"], temperature=body["temperature"], top_k=body["top_k"],
                                top_p=CONFIG.top_p, max_frames=body["max_new_tokens"])  # fmt: skip
        prompt = solo.build_prompt(text)
        rows = finished[tuple(prompt.input_ids.tolist())]
        assert_same_pcm(data, pcm_of_codes(solo, codec_frames(rows, solo.cfg.num_real_codes)), f"client {i}")
        alone = solo.generate(text, params).rows
        if torch.equal(rows, alone):
            assert_same_pcm(data, expected_pcm(solo, text, params), f"client {i} against the request alone")
        else:
            assert explain_divergence(solo, prompt, params, rows, alone) is not None
    wait_until_idle(serving)


def test_a_client_that_leaves_mid_stream_frees_its_request(served) -> None:
    serving, url = served
    before = serving.counts["cancelled"]
    text = " ".join(f"Sentence {i} keeps the greedy talker going for a while." for i in range(12))  # ~4 parts
    body = {"input": text, "temperature": 0.0, "max_new_tokens": 2000, "response_format": "pcm"}
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        # the iterator is held: a dropped one is closed at once, and httpx closes the connection with it (the client
        # would leave before the check, not at the end of the block)
        chunks = response.iter_raw()
        first = next(chunks)
        assert first and serving.active_requests == 1 and serving.talker.engine.requests, dict(serving.counts)
    t0 = time.monotonic()
    wait_until_idle(serving, timeout=10)  # slot, KV blocks and the queued next part all freed
    assert time.monotonic() - t0 < 5
    assert serving.counts["cancelled"] == before + 1
    # and one that leaves before its first byte
    before = serving.counts["cancelled"]
    with pytest.raises(httpx.ReadTimeout):  # the whole-file response never starts: the client gives up first
        httpx.post(url + "/v1/audio/speech", json=body | {"stream": False}, timeout=0.5)
    wait_until_idle(serving, timeout=10)
    assert serving.counts["cancelled"] == before + 1


LONG_TEXT = " ".join(f"This is sentence number {i}, one of many in a text longer than one prompt." for i in range(75))


def test_long_input_is_split_and_streamed_as_one_audio(served, solo, monkeypatch) -> None:
    """A ~5,600-character input (one prompt would be refused) is spoken in parts of one seed, in order; each part is
    tokenized once (checked before anything is queued, then queued as it was built)."""
    serving, url = served
    assert len(LONG_TEXT) > 5000
    with pytest.raises(ValueError, match="prompt is"):
        solo.build_prompt(LONG_TEXT)
    caps, built = [], []
    real_add, real_build = serving.talker.engine.add_request, serving.talker.tokenizer.build
    monkeypatch.setattr(serving.talker.engine, "add_request", lambda p, s, *a: caps.append(s) or real_add(p, s, *a))
    monkeypatch.setattr(serving.talker.tokenizer, "build", lambda t, *a: built.append(t) or real_build(t, *a))
    response = speech(url, input=LONG_TEXT, seed=21, response_format="pcm", max_new_tokens=30)
    assert response.status_code == 200, response.text
    assert response.content == expected_pcm(solo, LONG_TEXT, SamplingParams(**SERVED, seed=21, max_frames=30))
    assert len(caps) == len(_parts(LONG_TEXT)) > 30
    assert built == _parts(LONG_TEXT)  # once each, in order
    assert {s.seed for s in caps} == {21} and all(s.max_frames <= 30 for s in caps)
    greedy = speech(url, input=LONG_TEXT[:200], temperature=0.0, response_format="pcm")  # capped from the text
    assert greedy.status_code == 200
    texts = _parts(LONG_TEXT[:200])
    parts = caps[-len(texts) :]
    assert len(texts) == 2 and [s.max_frames for s in parts] == [frame_budget(t, 25) for t in texts]
    assert len(greedy.content) // 1920 <= sum(s.max_frames for s in parts)
    # a short input is one part: only max_new_tokens caps it, as vllm-omni's endpoint (it was capped from its text)
    short = speech(url, input="Hello world.", seed=4, response_format="pcm", max_new_tokens=200)
    assert short.status_code == 200 and caps[-1].max_frames == 200 > frame_budget("Hello world.", 25)
    wait_until_idle(serving)


def _parts(text: str) -> list[str]:
    from higgs_talker.splitting import split_text

    return split_text(text, PART_CHARS)


def test_a_voice_uploaded_then_used(served, solo, client, tmp_path) -> None:
    serving, url = served
    recording = solo.generate("Hello there, this is me.", SamplingParams(seed=3, temperature=0.0), max_frames=50)
    wav = write_wav(tmp_path / "me.wav", recording.audio, 24000).read_bytes()
    files = {"audio": ("me.wav", wav, "audio/wav")}
    added = httpx.post(url + "/v1/audio/voices", files=files, data={"name": "me", "ref_text": "Hello there."})
    assert added.status_code == 200, added.text
    assert added.json()["name"] == "me" and added.json()["frames"] == recording.num_frames
    assert "me" in [v["name"] for v in httpx.get(url + "/v1/audio/voices").json()["data"]]
    check_error(httpx.post(url + "/v1/audio/voices", files=files, data={"name": "me"}), 409, "name")
    check_error(httpx.post(url + "/v1/audio/voices", files=files, data={"name": "no/slash"}), 400, "name")
    check_error(httpx.post(url + "/v1/audio/voices", files=files, data={"name": "default"}), 400, "name")
    not_wav = {"audio": ("x.wav", b"hello", "audio/wav")}
    check_error(httpx.post(url + "/v1/audio/voices", files=not_wav, data={"name": "x"}), 400, "audio")
    check_error(httpx.post(url + "/v1/audio/voices", data={"name": "x"}), 400, "audio")

    samples, rate = decode_wav(wav)
    voice = Reference(codes=solo.codec_loader.reference_codes(samples, rate), text="Hello there.")
    text, params = "Say it like me.", SamplingParams(**SERVED, seed=4, max_frames=40)
    want = expected_pcm(solo, text, params, voice)
    got = client.audio.speech.create(model="tiny", voice="me", input=text, response_format="pcm",
                                     extra_body={"seed": 4, "max_new_tokens": 40})  # fmt: skip
    assert got.content == want
    inline = speech(url, input=text, seed=4, max_new_tokens=40, response_format="pcm", ref_text="Hello there.",
                    ref_audio="data:audio/wav;base64," + base64.b64encode(wav).decode())  # fmt: skip
    assert inline.status_code == 200 and inline.content == want  # the same voice given inline, vllm-omni's way
    for encoded in (base64.encodebytes(wav).decode(), base64.urlsafe_b64encode(wav).decode()):  # line breaks, -_
        again = speech(url, input=text, seed=4, max_new_tokens=40, response_format="pcm", ref_text="Hello there.",
                       ref_audio="data:audio/wav;base64," + encoded)  # fmt: skip
        assert again.status_code == 200 and again.content == want, again.text[:300]
    assert speech(url, input=text, voice={"id": "me"}, seed=4, max_new_tokens=40, response_format="pcm").content == want
    # names match in any case, as vllm-omni lower-cases them: one voice, and "Default" is the model's own
    assert speech(url, input=text, voice="ME", seed=4, max_new_tokens=40, response_format="pcm").content == want
    check_error(httpx.post(url + "/v1/audio/voices", files=files, data={"name": "Me"}), 409, "name")
    check_error(httpx.post(url + "/v1/audio/voices", files=files, data={"name": "DEFAULT"}), 400, "name")
    own = speech(url, input=text, seed=4, max_new_tokens=40, response_format="pcm").content
    assert speech(url, input=text, voice="Default", seed=4, max_new_tokens=40, response_format="pcm").content == own
    assert httpx.delete(url + "/v1/audio/voices/me").status_code == 200
    check_error(httpx.delete(url + "/v1/audio/voices/me"), 404, "name")
    assert "built-in" in check_error(httpx.delete(url + "/v1/audio/voices/Default"), 400, "name")["message"]
    check_error(speech(url, input=text, voice="me"), 400, "voice")


def test_an_uploaded_voices_ref_text_is_stripped_as_upstream_does(solo, tmp_path) -> None:
    """vllm-omni's upload_voice keeps ``ref_text.strip() or None`` (serving_speech.py:873-875), so its voice-clone
    prompt holds the stripped words, and a blank ref_text is a voice without one (it was a 400 here)."""
    serving = SpeechServing(solo, CONFIG)
    recording = solo.generate("Hello there, this is me.", SamplingParams(seed=3, temperature=0.0), max_frames=30)
    wav = write_wav(tmp_path / "me.wav", recording.audio, 24000).read_bytes()
    padded = asyncio.run(serving.add_voice("padded", wav, "  Hello there.\n"))
    assert padded.ref_text == serving.voices.get("padded").reference.text == "Hello there."
    blank = asyncio.run(serving.add_voice("blank", wav, " \n "))
    assert blank.ref_text is None and serving.voices.get("blank").reference.text is None


BAD = [
    ({}, 400, "input"),
    ({"input": "   "}, 400, "input"),
    ({"input": "x" * 6001}, 400, "input"),
    ({"input": "Hi <|audio|> there."}, 400, "input"),
    ({"input": "Hi.", "foo": 1}, 400, "foo"),
    ({"input": "Hi.", "model": "tts-1"}, 404, "model"),
    ({"input": "Hi.", "voice": "alloy"}, 400, "voice"),
    ({"input": "Hi.", "voice": 5}, 400, "voice"),  # not "voice.str", a member of the union
    ({"input": "Hi.", "voice": {"name": "x"}}, 400, "voice"),
    ({"input": "Hi.", "voice": {"id": "default", "name": "x"}}, 400, "voice"),  # was param "voice.str"
    ({"input": "Hi.", "speed": 1.5}, 400, "speed"),
    ({"input": "Hi.", "instructions": "whisper"}, 400, "instructions"),
    ({"input": "Hi.", "response_format": "ogg"}, 400, "response_format"),
    ({"input": "Hi.", "response_format": "MP3"}, 400, "response_format"),  # OpenAI's names are lower case
    ({"input": "Hi.", "stream_format": "video"}, 400, "stream_format"),
    ({"input": "Hi.", "stream_format": "sse", "stream": False}, 400, "stream"),
    ({"input": "Hi.", "temperature": -1}, 400, "temperature"),
    ({"input": "Hi.", "temperature": 1e39}, 400, "temperature"),
    ({"input": "Hi.", "top_p": 0}, 400, "top_p"),
    ({"input": "Hi.", "top_k": -2}, 400, "top_k"),
    ({"input": "Hi.", "seed": -1}, 400, "seed"),
    ({"input": "Hi.", "seed": 2**63}, 400, "seed"),
    ({"input": "Hi.", "max_new_tokens": 0}, 400, "max_new_tokens"),
    ({"input": "Hi.", "max_new_tokens": 2049}, 400, "max_new_tokens"),  # one past the limit
    ({"input": "Hi.", "max_new_tokens": "many"}, 400, "max_new_tokens"),
    ({"input": "Hi.", "max_new_tokens": "10"}, 400, "max_new_tokens"),  # strict types, as OpenAI's schema
    ({"input": "Hi.", "seed": 7.0}, 400, "seed"),
    ({"input": "Hi.", "stream": "yes"}, 400, "stream"),
    ({"input": "Hi.", "speed": True}, 400, "speed"),
    ({"input": 5}, 400, "input"),
    ({"input": "Hi.", "extra_params": {"foo": 1}}, 400, "extra_params.foo"),
    ({"input": "Hi.", "extra_params": {"temperature": "hot"}}, 400, "extra_params.temperature"),
    ({"input": "Hi.", "extra_params": {"top_p": 2}}, 400, "extra_params.top_p"),
    ({"input": "Hi.", "top_p": 2}, 400, "top_p"),
    ({"input": "Hi.", "temperature": 0.5, "extra_params": {"temperature": 0.7}}, 400, "temperature"),
    ({"input": "Hi.", "extra_params": [1]}, 400, "extra_params"),
    ({"input": "Hi.", "ref_text": "Hello."}, 400, "ref_text"),
    ({"input": "Hi.", "ref_audio": "http://example.invalid/a.wav"}, 400, "ref_audio"),
    ({"input": "Hi.", "ref_audio": "data:audio/wav;base64,@@@"}, 400, "ref_audio"),
    ({"input": "Hi.", "ref_audio": "data:audio/wav;base64," + base64.b64encode(b"RIFF....WAVE").decode()}, 400,
     "ref_audio"),
    ({"input": "Hi.", "ref_audio": "data:audio/wav;base64,AAAA", "voice": "someone"}, 400, "voice"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "param"), BAD, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_requests_get_a_json_error_naming_the_field(served, body, status, param) -> None:
    check_error(speech(served[1], **body), status, param)


def test_error_codes_are_openais_strings(client) -> None:
    """OpenAI's ``error.code`` is a string naming the error, or null; the HTTP status is the response's. A number
    there breaks typed clients: OpenAI's Java SDK raises on reading it, so the server's message was lost."""
    with pytest.raises(openai.NotFoundError) as exc:
        client.audio.speech.create(model="tts-1", voice="default", input="Hi.")
    assert exc.value.body["code"] == "model_not_found" and exc.value.param == "model"
    with pytest.raises(openai.BadRequestError) as exc:
        client.audio.speech.create(model="tiny", voice="alloy", input="Hi.")
    assert exc.value.body["code"] is None and exc.value.param == "voice"
    assert exc.value.type == "invalid_request_error"


def test_null_is_the_default_and_an_integer_is_a_number(served) -> None:
    """``null`` for a field is its default (as vllm-omni types them: optional), and ``"speed": 1`` is 1.0."""
    _, url = served
    body = {"input": "Hi.", "seed": 1, "max_new_tokens": 6, "temperature": 0}
    got = speech(url, **body, speed=None, response_format=None, stream=False)
    assert got.status_code == 200 and got.headers["content-type"] == "audio/wav", got.text[:300]
    assert speech(url, **body, speed=1, response_format="wav", stream=False).content == got.content


def test_bad_bodies(served) -> None:
    serving, url = served
    headers = {"content-type": "application/json"}
    check_error(httpx.post(url + "/v1/audio/speech", content=b"{nope", headers=headers), 400, "body")
    # not UTF-8 (JSON must be): FastAPI's own 400 "There was an error parsing the body" had param null
    latin1 = httpx.post(url + "/v1/audio/speech", content='{"input": "Café."}'.encode("latin-1"), headers=headers)
    assert "not valid JSON" in check_error(latin1, 400, "body")["message"]
    deep = b'{"input": "Hi.", "extra_params": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"  # json.loads recursion
    assert "nests too deeply" in check_error(httpx.post(url + "/v1/audio/speech", content=deep, headers=headers), 400,
                                             "body")["message"]  # fmt: skip
    big = json.dumps({"input": "Hi.", "ref_text": "x" * (1 << 20)}).encode()
    check_error(httpx.post(url + "/v1/audio/speech", content=big, headers=headers), 413, "body")

    def chunked():  # no Content-Length: the limit holds while the body is read
        yield b'{"input": "Hi.", "ref_text": "'
        for _ in range(40):
            yield b"x" * 32768
        yield b'"}'

    check_error(httpx.post(url + "/v1/audio/speech", content=chunked(), headers=headers), 413, "body")
    check_error(httpx.get(url + "/v1/nothing"), 404, None)
    for kind in ("application/x-www-form-urlencoded", "text/plain"):  # curl -d without -H: a form type
        form = httpx.post(url + "/v1/audio/speech", content=b'{"input": "Hi."}', headers={"content-type": kind})
        assert f"Content-Type: application/json (got {kind})" in check_error(form, 400, "body")["message"]
    # no Content-Type at all (requests.post(url, data=json.dumps(body))): FastAPI >= 0.132 reads no JSON then, and
    # the error said "body: Input should be a valid dictionary"; older FastAPI parses the body (then it is spoken)
    bare = httpx.post(url + "/v1/audio/speech", content=b'{"input": "Hi.", "max_new_tokens": 5}')
    if bare.status_code != 200:
        assert "Content-Type: application/json (none was given)" in check_error(bare, 400, "body")["message"]
    # a lone surrogate is valid JSON but not text; it reached the tokenizer, whose TypeError was a 500 in plain text
    surrogate = httpx.post(url + "/v1/audio/speech", content=b'{"input": "Hi \\ud800 there."}', headers=headers)
    message = check_error(surrogate, 400, "input")["message"]
    assert message.startswith("input holds") and "not valid Unicode" in message, message
    ok = speech(url, input="Still fine.", seed=1, max_new_tokens=20)
    assert ok.status_code == 200
    wait_until_idle(serving)


def test_an_unexpected_exception_is_a_json_500(served, monkeypatch) -> None:
    serving, url = served

    def broken():
        raise RuntimeError("a bug")

    monkeypatch.setattr(serving, "voice_list", broken)
    assert "a bug" in check_error(httpx.get(url + "/v1/audio/voices"), 500, None)["message"]


def test_a_failing_request_leaves_the_others_alone(served, solo, monkeypatch) -> None:
    serving, url = served
    talker = serving.talker
    real_blocks = talker._blocks

    def blocks(prepared, *args, **kwargs):  # stream_audio's frames (in blocks) of the request's PreparedText
        frames = real_blocks(prepared, *args, **kwargs)
        if "poison" not in prepared.text:
            return frames

        def failing():
            with contextlib.closing(frames):
                sent = 0
                for block in frames:
                    if sent + block.shape[0] > 12:
                        raise GenerationError("injected failure")
                    sent += block.shape[0]
                    yield block

        return failing()

    monkeypatch.setattr(talker, "_blocks", blocks)
    text, params = "An innocent request.", SamplingParams(**SERVED, seed=8, max_frames=60)
    want = expected_pcm(solo, text, params)
    results = {}

    def run(key, **body):
        results[key] = speech(url, **body)

    threads = [
        threading.Thread(target=run, args=("good",), kwargs={"input": text, "seed": 8, "max_new_tokens": 60,
                                                             "response_format": "pcm"}),
        threading.Thread(target=run, args=("file",), kwargs={"input": "poison one", "temperature": 0.0,
                                                             "stream": False}),
        threading.Thread(target=run, args=("sse",), kwargs={"input": "poison two", "temperature": 0.0,
                                                            "stream_format": "sse"}),
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results["good"].status_code == 200, results["good"].text[:300]
    assert_same_pcm(results["good"].content, want, "the good request beside two failing ones")
    assert "injected failure" in check_error(results["file"], 500, None)["message"]
    events = [json.loads(x[6:]) for x in results["sse"].text.splitlines() if x.startswith("data: ")]
    assert events[-1]["type"] == "error" and "injected failure" in events[-1]["error"]["message"]
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
    wait_until_idle(serving)


def test_a_prompt_longer_than_max_model_len_is_a_400_before_anything_is_queued(tiny_dir, solo, tmp_path) -> None:
    """The engine refuses a prompt that leaves no room within max_model_len when it is queued, in the worker: that
    was a 500 (a 200 and a cut stream before that). The server checks it with the rest of the request: a 400 naming
    the field at fault (input, or the reference that makes the prompt long), and no upload of a voice too long."""
    small = SpeechServing(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=1, max_model_len=128), CONFIG)
    recording = solo.generate("Hello there, this is me.", SamplingParams(seed=3, temperature=0.0), max_frames=150)
    wav = write_wav(tmp_path / "me.wav", recording.audio, 24000).read_bytes()
    inline = "data:audio/wav;base64," + base64.b64encode(wav).decode()
    with running(small) as url:
        # 140 characters, one part: 143 prompt tokens; a 6 s reference: 150 frames
        for body, param in [({"input": "Hi there my friend. " * 7}, "input"), ({"ref_audio": inline}, "ref_audio")]:
            for mode in ({}, {"stream": False}, {"stream_format": "sse"}):
                error = check_error(speech(url, **{"input": "Hi.", **body, **mode}), 400, param)
                assert "max_model_len" in error["message"], error
        upload = httpx.post(url + "/v1/audio/voices", files={"audio": ("me.wav", wav)}, data={"name": "me"})
        assert "max_model_len" in check_error(upload, 400, "audio")["message"]
        assert speech(url, input="Hi.", max_new_tokens=5).status_code == 200  # a prompt that fits
    assert small.counts == {"finished": 1, "cancelled": 0, "failed": 0}


@pytest.mark.parametrize("mode", [{}, {"stream_format": "sse"}], ids=["audio", "sse"])
def test_a_streamed_request_that_fails_before_its_first_byte_gets_a_status(served, monkeypatch, mode) -> None:
    """Nothing is sent before the first audio, so a failure or a timeout before it is still a status code with the
    JSON error, as for a whole file (it was a 200 and then a cut body, or an SSE error event)."""
    serving, url = served
    real_blocks = serving.talker._blocks

    def blocks(*args, **kwargs):
        frames = real_blocks(*args, **kwargs)

        def failing():
            with contextlib.closing(frames):
                raise GenerationError("injected failure")
            yield  # a generator, as _blocks

        return failing()

    monkeypatch.setattr(serving.talker, "_blocks", blocks)
    body = {"input": "Fails at once.", "temperature": 0.0, "max_new_tokens": 20, **mode}
    assert "injected failure" in check_error(speech(url, **body), 500, None)["message"]
    monkeypatch.undo()
    impatient = SpeechServing(serving.talker, ServeConfig(model_name="tiny", request_timeout_s=0.001))
    with running(impatient) as impatient_url:  # no frame comes within 1 ms
        check_error(speech(impatient_url, **body), 408, "timeout")
    wait_until_idle(serving)


def test_a_request_past_its_timeout_is_cancelled(served) -> None:
    serving, _ = served
    impatient = SpeechServing(serving.talker, ServeConfig(model_name="tiny", request_timeout_s=0.3))
    with running(impatient) as url:
        body = {"input": "Greedy and long. " * 10, "temperature": 0.0, "max_new_tokens": 2000}
        check_error(speech(url, **body, stream=False), 408, "timeout")
        with httpx.stream("POST", url + "/v1/audio/speech", json=body | {"stream_format": "sse"}) as response:
            if response.status_code == 200:  # the first event came within the time: it ends with an error event
                events = [json.loads(x[6:]) for x in response.iter_lines() if x.startswith("data: ")]
                assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "timeout_error"
            else:  # a slow machine: the time ran out before the first byte
                response.read()
                check_error(response, 408, "timeout")
    wait_until_idle(serving)  # the workers have seen their cancel flags
    assert impatient.counts["cancelled"] == 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_cli_server_stops_cleanly_mid_stream(tiny_dir: Path, sig) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "higgs_talker.cli", "serve", str(tiny_dir), "--port", "0", "--max-num-seqs", "2",
         "--max-model-len", "1024", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # never blocks the test
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any("serving 'tiny'" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        url = next(x for x in lines if "serving 'tiny'" in x).split(" at ")[1].split()[0]
        body = {"input": "Greedy and long. " * 10, "temperature": 0.0, "max_new_tokens": 2000, "response_format": "pcm"}
        with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=TIMEOUT) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()
            assert next(chunks)
            t0 = time.monotonic()
            proc.send_signal(sig)
            with pytest.raises(httpx.RemoteProtocolError):  # cut short, not ended as if complete
                for _ in chunks:
                    pass
        rc = proc.wait(timeout=20)
        assert time.monotonic() - t0 < 10
        reader.join(timeout=5)
        out = "".join(lines)
        assert rc == (0 if sig == signal.SIGINT else -signal.SIGTERM), out
        assert "Finished server process" in out
        assert "Traceback" not in out and "ERROR" not in out, out  # a cut stream is no error
        if sig == signal.SIGINT:
            assert "server stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bench_serve_smoke(tmp_path: Path, monkeypatch) -> None:
    """benchmarks/bench_serve.py on CPU with the tiny shape: both paths, both samplings (deploy, the headline, and
    greedy), every field the JSON promises."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the tiny codec is built there, not in ~/.cache
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_serve

    data = json.loads(Path(bench_serve.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]).path).read_text())
    for key in ("date", "command", "torch", "gpu", "targets", "build_s"):
        assert key in data["meta"], key
    rows = data["rows"]
    want = {(p, s, c) for p in ("direct", "http") for s in ("deploy", "greedy") for c in (1, 2)}
    assert {(r["path"], r["sampling"], r["concurrency"]) for r in rows} == want
    assert data["meta"]["headline_sampling"] == "deploy"
    for r in rows:
        assert r["status"] == "ok", r
        assert r["requests"] == 2 and r["ttfa_ms_p50"] > 0 and r["rtf_p50"] > 0 and r["audio_s_per_s"] > 0
    requests = data["requests"]
    assert len(requests) == 16 and all(0.3 < r["audio_s"] < 1.0 for r in requests)  # the 0.4-0.8 s asked for
    assert set(data["targets_met"]) == set(bench_serve.TARGETS)


def test_bench_serve_frames_path_counts_the_engines_frames(tmp_path: Path, monkeypatch) -> None:
    """The ``frames`` path (the direct engine with no codec) reports the frames asked for as audio seconds, with
    the switch interval it was given; without an HTTP path the run needs no server (uvicorn cannot be imported
    here, as on a GPU image without the server extra)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_serve

    for name in [m for m in sys.modules if m == "uvicorn" or m.startswith(("uvicorn.", "higgs_talker.serve.app"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ImportError

    before = sys.getswitchinterval()
    try:
        argv = ["--device", "cpu", "--tiny", "--paths", "frames", "--levels", "1", "--sampling", "greedy",
                "--switch-interval-ms", "1", "--out", str(tmp_path)]  # fmt: skip
        data = json.loads(Path(bench_serve.main(argv).path).read_text())
    finally:
        sys.setswitchinterval(before)
    assert data["meta"]["switch_interval_s"] == 0.001
    (row,) = data["rows"]
    assert row["path"] == "frames" and row["status"] == "ok", row
    for r in data["requests"]:
        assert r["audio_s"] == r["frames"] / 25, r  # EOC suppressed: every request runs to the frames asked for


def test_the_servers_connections_send_without_nagles_delay(solo) -> None:
    """Each connection the server accepts has TCP_NODELAY: asyncio sets it only where the listening socket's proto
    says TCP. With Nagle on, a streamed body's first chunk waited for the client's delayed ACK of the headers (40 ms
    more to the first audio byte on loopback, seen with this server before the fix)."""
    import asyncio
    import socket

    _, sock = make_server(SpeechServing(solo, CONFIG), "127.0.0.1", 0)
    seen: list[int] = []

    async def main() -> None:
        async def accepted(reader, writer) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    try:
        asyncio.run(main())
    finally:
        sock.close()
    assert seen and seen[0] != 0, f"TCP_NODELAY on the accepted connection: {seen}"


def test_part_chars_0_speaks_one_prompt_as_vllm_omni_does(solo) -> None:
    """``--part-chars 0``: no split and no cap from the text (vllm-omni's endpoint speaks one prompt of any length,
    up to the token cap); the default splits the same text and caps each part."""
    text = " ".join(f"Sentence {i} is here." for i in range(30))  # 600 characters
    whole = asyncio.run(SpeechServing(solo, ServeConfig(model_name="tiny", part_chars=0)).prepare(
        SpeechRequest(input=text, max_new_tokens=700)))  # fmt: skip
    assert len(whole.prepared.parts) == 1
    assert whole.prepared.parts[0].prompt.input_ids.tolist() == solo.build_prompt(text).input_ids.tolist()
    assert whole.prepared.parts[0].sampling.max_frames == 700
    split = asyncio.run(SpeechServing(solo, CONFIG).prepare(SpeechRequest(input=text, max_new_tokens=700)))
    assert len(split.prepared.parts) > 1 and all(p.sampling.max_frames < 700 for p in split.prepared.parts)
    with pytest.raises(ValueError, match="part_chars must be an integer >= 0, got -1"):
        ServeConfig(part_chars=-1)


@pytest.mark.parametrize(("model", "name"), [(".", "ckpt"), ("./", "ckpt"), ("../ckpt/", "ckpt"), ("tiny", "tiny")])
def test_the_served_model_name_is_the_checkpoints_directory_however_it_is_written(monkeypatch, tmp_path, model, name):
    """``serve .`` used to fail on an empty --served-model-name the user never gave (``Path('.').name`` is '')."""
    import argparse

    from higgs_talker.serve.options import _config, add_arguments

    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert _config(parser.parse_args([model])).model_name == name


def test_every_refusal_is_an_openai_invalid_request_error_with_a_code(served):
    """OpenAI's error types: a refused request is an invalid_request_error; the code tells what kind."""
    missing = httpx.delete(f"{served[1]}/v1/audio/voices/nobody", timeout=TIMEOUT)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "not_found") and "nobody" in error["message"]


def test_the_wire_formats_match_independent_writers_and_the_sse_framing():
    """The WAV header equals what Python's ``wave`` module writes for the same samples (RIFF size 36 + data, byte
    rate 2 x rate, block align 2), the streamed one differs only in its two sizes (0xFFFFFFFF), and each server-sent
    event is one ``data:`` line closed by a blank line, so a stream of them splits on blank lines (SSE's framing)."""
    import io
    import wave

    from higgs_talker.serve.encoding import UNKNOWN_SIZE, sse_event, wav_header
    from higgs_talker.serve.protocol import SpeechAudioDelta

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(b"\x01\x02" * 500)
    written = buf.getvalue()
    assert wav_header(24000, 1000) == written[:44] and len(written) == 44 + 1000
    streamed = bytearray(written[:44])
    streamed[4:8] = streamed[40:44] = UNKNOWN_SIZE.to_bytes(4, "little")
    assert wav_header(24000) == bytes(streamed)
    events = [SpeechAudioDelta(audio=a) for a in ("AAEC", "AwQF")]
    stream = b"".join(sse_event(e) for e in events)
    blocks = [b for b in stream.split(b"\n\n") if b]
    assert stream.endswith(b"\n\n") and len(blocks) == 2
    for block, event in zip(blocks, events, strict=True):
        (line,) = block.split(b"\n")
        assert line.startswith(b"data: ") and json.loads(line[6:]) == event.model_dump()


def test_a_request_at_the_limits_is_taken(solo):
    """The limits themselves are allowed: an input of exactly max_input_chars and max_new_tokens equal to the
    server's limit (one more of either is a 400: BAD)."""
    serving = SpeechServing(solo, CONFIG)
    text = ("Word. " * 1000)[: CONFIG.max_input_chars]
    job = asyncio.run(serving.prepare(SpeechRequest(input=text, max_new_tokens=CONFIG.max_new_tokens, seed=1)))
    assert len(text) == CONFIG.max_input_chars and job.prepared.text == text
    assert all(part.sampling.max_frames <= CONFIG.max_new_tokens for part in job.prepared.parts)
