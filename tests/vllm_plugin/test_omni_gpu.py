"""The talker in vllm-omni's own two-stage pipeline on a GPU (H200: vLLM 0.26 / vllm-omni 0.26). Written on a
CPU-only machine, where ``vllm_omni.Omni`` does not run; on the H200 only its low-latency ``Omni`` run has
finished so far (2026-12-03, twice: audio for every request; ``benchmarks/results/h200_20261203{b,c}``); its
comparisons failed the first time on the last frame a ``max_tokens`` cut drops (expected since) and did not
finish the second time. What it relies on ran on CPU (tests/vllm_plugin/test_omni_checkpoint.py: vllm-omni's code2wav
loads the checkpoint's codec and decodes like ours, and its async-chunk hand-over of our rows gives our
``UPSTREAM_CHUNKING`` stream bit for bit).

A small checkpoint (head_dim 64, bf16 talker, EOC pushed down) with the real-layout random codec
(``benchmarks/omni_checkpoint.py``) runs through ``Omni(model, deploy_config)`` in both of our deploy profiles
(``omni_run.py`` in its own process), Stage 1 in float32:

- offline, greedy and seeded top-k/top-p requests and a voice clone (sent as vllm-omni 0.26's speech endpoint
  sends one: -100 placeholders, rows without positions): the audio equals our direct engine's codes (same GPU, bf16,
  eager) streamed through our codec with vllm-omni's chunking, within float tolerance (TF32 convolutions); where
  the audio parts, the direct engine must have a near tie (bf16: two codes within the measured score error,
  ``_reference_check``) at a frame within the decoder's reach of where it parts; three of them again in one call,
  decoded as one Stage-0 batch, each against the direct engine alone; the same audio against a direct engine
  with one projection 5% off must fail the comparison (its mutation test); Stage 0's log names the graph path
  its profile calls for; a batch on too few KV blocks (vLLM preempts and recomputes requests) still gives each
  request its own audio;
- ``vllm-omni serve`` (low-latency profile): the ``openai`` client's ``audio.speech.create`` (its ``voice`` sent as
  null through ``extra_body``: vllm-omni refuses a voice nobody uploaded) and httpx streaming (PCM and WAV) give
  the offline audio of the same seed; a client that leaves mid-stream does not block the next request; bad
  requests get a 4xx with a message.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm.config")
pytest.importorskip("vllm_omni")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _reference_check import broken_checkpoint, score_bound, teacher_forced  # noqa: E402
from _served import run_served  # noqa: E402
from bench_omni import deploy_yaml, derived_yaml, start_server, stop_server, talker_env  # noqa: E402
from omni_checkpoint import write_omni_checkpoint  # noqa: E402

from higgs_talker import HiggsTalker, Reference, SamplingParams  # noqa: E402
from higgs_talker.codec import UPSTREAM_CHUNKING, Codec  # noqa: E402

SCRIPT = Path(__file__).with_name("omni_run.py")
HOP = 960
DEPLOY = {"temperature": 1.0, "top_k": 50, "top_p": 0.95}  # the profiles' Stage-0 defaults (sampled: seeded)
SPEC = [
    {"key": "greedy", "text": "Hello there, this prompt is long enough for a few chunks.", "max_tokens": 70,
     "temperature": 0.0},
    {"key": "topkp", "text": "Top k and top p.", "temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 7,
     "max_tokens": 40},
    {"key": "deploy", "text": "The deploy sampling, seeded.", "seed": 11, "max_tokens": 45},
    {"key": "short", "text": "Short.", "temperature": 0.0, "max_tokens": 12},
    {"key": "clone", "text": "A cloned voice says this.", "temperature": 0.0, "max_tokens": 40,
     "ref_codes": torch.randint(0, 1024, (12, 8), generator=torch.Generator().manual_seed(3)).tolist()},
]  # fmt: skip
# sent together in one call (greedy, one length: the offline API takes one sampling per stage), so Stage 0 decodes
# them as one batch: prompts of different lengths, a voice clone among them
BATCH = {"keys": ["greedy", "short", "clone"], "max_tokens": 40}
# a Stage-0 KV cache too small for this batch (blocks of 16 tokens: about two of the three requests at full
# length), so vLLM preempts requests and recomputes them, and the adapter feeds their rows again (it logs that)
SMALL_KV = {"keys": ["greedy", "topkp", "deploy"], "max_tokens": 120, "alone": False, "blocks": 20}
PROFILES = ("low_latency", "high_throughput")
# Stage 0 sized for the small checkpoint; Stage 1 in float32, as our codec decodes
STAGES = {0: {"gpu_memory_utilization": 0.3, "max_model_len": 1024, "max_num_batched_tokens": 1024,
              "dtype": "bfloat16"},
          1: {"gpu_memory_utilization": 0.15, "dtype": "float32"}}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return write_omni_checkpoint(tmp_path_factory.mktemp("omni") / "ckpt", shape="small")


_OFFLINE: dict[str, dict[str, torch.Tensor]] = {}
_LOGS: dict[str, str] = {}


def offline_audio(ckpt: Path, profile: str, tmp: Path, small_kv: bool = False) -> dict[str, torch.Tensor]:
    """Every SPEC request's audio from ``Omni`` with our ``profile``, alone and BATCH's batched (``small_kv``:
    SMALL_KV's batch only, on its few KV blocks); one run per variant per session, its log in ``_LOGS``."""
    name = profile + ("_small_kv" if small_kv else "")
    if name not in _OFFLINE:
        stages = STAGES | {0: STAGES[0] | {"num_gpu_blocks_override": SMALL_KV["blocks"]}} if small_kv else STAGES
        yaml_path = derived_yaml(deploy_yaml("ours", profile), tmp / f"{name}.yaml", stages)
        out = tmp / name
        out.mkdir()
        log = Path(os.environ.get("HIGGS_VLLM_LOG_DIR") or tmp, f"omni_{name}.log")
        batch = SMALL_KV if small_kv else BATCH
        cmd = [sys.executable, str(SCRIPT), str(ckpt), str(yaml_path), json.dumps(SPEC), str(out), json.dumps(batch)]
        result = run_served(cmd, talker_env("ours"), timeout=900, log=log)
        saved = [("batched_" if r.get("batched") else "") + r["key"] for r in result["results"]]
        _OFFLINE[name] = {key: torch.load(out / f"{key}.pt") for key in saved}
        _LOGS[name] = log.read_text(errors="replace")
    return _OFFLINE[name]


@pytest.fixture(scope="module", params=PROFILES)
def offline(request, ckpt, tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    return request.param, offline_audio(ckpt, request.param, tmp_path_factory.mktemp("run"))


def sdpa_talker(ckpt: Path) -> HiggsTalker:
    """Our direct engine on the GPU, eager, one request at a time, on torch SDPA and torch kernels (see ``solo``)."""
    from higgs_talker.attention import SdpaAttention

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError: SDPA is chosen
        talker = HiggsTalker.from_pretrained(ckpt, device="cuda", dtype="bfloat16", graph_mode="eager",
                                             max_num_seqs=1, max_model_len=512, codec=False)  # fmt: skip
    assert isinstance(talker.engine.runner.attn, SdpaAttention), type(talker.engine.runner.attn)
    return talker


@pytest.fixture(scope="module")
def solo(ckpt) -> HiggsTalker:
    """Our direct engine on the same GPU, one request at a time, eager (its sampler can be teacher-forced), on
    torch SDPA and torch kernels: FlashInfer is made unimportable while it is built. The FlashInfer here is
    vLLM's (0.6.14), whose JIT compiled our engine's kernels for over a minute on the H200 (2026-12-03) before the
    first comparison; a reference needs none of them (bf16 either way, near ties judged by ``score_bound``)."""
    return sdpa_talker(ckpt)


@pytest.fixture(scope="module")
def codec(ckpt) -> Codec:
    return Codec.from_pretrained(ckpt, device="cuda")  # float32, as Stage 1 runs in STAGES


def reference_of(spec: dict) -> Reference | None:
    """A clone request's voice: its aligned codes [T, C] (vllm-omni gets the same rows, delayed, at -100
    placeholders: ``omni_run.omni_prompt``)."""
    return Reference(codes=torch.tensor(spec["ref_codes"])) if spec.get("ref_codes") is not None else None


def params_of(spec: dict, solo: HiggsTalker) -> SamplingParams:
    chosen = DEPLOY | {k: spec[k] for k in ("temperature", "top_k", "top_p") if k in spec}
    return SamplingParams(temperature=chosen["temperature"], top_k=chosen["top_k"], top_p=chosen["top_p"],
                          seed=spec.get("seed"), max_frames=spec["max_tokens"] - solo.cfg.num_codebooks)  # fmt: skip


def direct(solo: HiggsTalker, codec: Codec, spec: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, audio): the direct engine's rows for ``spec`` and their frames streamed through our codec with
    vllm-omni's chunking (equal to vllm-omni's hand-over + code2wav: test_omni_checkpoint.py), less the last frame
    where ``max_tokens`` cut the request: vllm-omni's runner (0.26-0.30) publishes a step's row on the request's
    next forward, so the row sampled on the step that reaches ``max_tokens`` never reaches Stage 1 (SPEC 4.10;
    seen on the H200: 70 / 40 / 45 / 12 tokens gave 61 / 31 / 36 / 3 frames, the direct engine's 62 / 32 / 37 / 4
    less one). Those requests never end on EOC here (the checkpoint pushes EOC down), so each is cut."""
    result = solo.generate(spec["text"], params_of(spec, solo), reference=reference_of(spec))
    frames = result.codes
    if len(result.rows) == spec["max_tokens"]:  # cut by max_tokens: its last row is never published
        frames = frames[:-1]
    decoder, chunks = codec.stream(UPSTREAM_CHUNKING), []
    for frame in frames:
        chunks.append(decoder.push(frame))
    chunks.append(decoder.finish())
    return result.rows.long().cpu(), torch.cat([c.float().cpu() for c in chunks if c is not None])


def near_tie_within_reach(solo: HiggsTalker, spec: dict, rows: torch.Tensor, frame: int) -> bool:
    """Whether the direct engine, teacher-forced on its own rows, ranked two codes within the measured bf16 score
    error at a row whose frame (row - codebook) lies within the decoder's reach of ``frame``."""
    prompt = solo.build_prompt(spec["text"], reference_of(spec))
    forced = teacher_forced(solo, prompt, params_of(spec, solo), rows)
    best2 = forced["scores"].float().topk(2, dim=-1).values  # [T, C, 2]
    gap = best2[..., 0] - best2[..., 1]
    near = gap <= score_bound(solo).code * forced["scale"]  # [T, C]
    t, c = rows.shape
    frames = torch.arange(t)[:, None] - torch.arange(c)[None]
    reach = 11  # decoder reach (10) plus one frame for a window edge
    return bool((near & (frames >= frame - reach) & (frames <= frame + reach)).any())


def assert_same_audio(got: torch.Tensor, want: torch.Tensor, what: str, solo=None, spec=None, rows=None) -> None:
    """``got`` equals ``want`` within float tolerance, or (given the run's spec) parts at a near tie."""
    assert got.numel() == want.numel(), f"{what}: {got.numel()} samples, the direct engine's audio has {want.numel()}"
    tol = 1e-3 * float(want.abs().max()) + 1e-5  # TF32 convolutions on either side
    bad = ((got - want).abs() > tol).nonzero()
    if not len(bad):
        return
    frame = int(bad[0]) // HOP
    assert solo is not None and near_tie_within_reach(solo, spec, rows, frame), (
        f"{what}: the audio parts from the direct engine's at frame {frame} (max |diff| "
        f"{float((got - want).abs().max()):.3g}, peak {float(want.abs().max()):.3g}) with no near tie there"
    )


def test_the_adapter_takes_the_graph_path_its_profile_calls_for(offline):
    """Stage 0's log (our lines reach it through vLLM's handlers): under the low-latency profile vLLM captures FULL
    decode graphs and our local MLP graphs stay off; under the high-throughput one (enforce_eager) they are on and
    every bucket captured."""
    profile, _ = offline
    log = _LOGS[profile]
    want = {"low_latency": "local MLP graphs off: vLLM captures CUDA graphs",
            "high_throughput": "local MLP graphs on: vLLM enforce_eager=True"}[profile]  # fmt: skip
    assert want in log, [x for x in log.splitlines() if "higgs" in x.lower()][:20]
    assert "capture failed" not in log


@pytest.mark.parametrize("index", range(len(SPEC)), ids=[s["key"] for s in SPEC])
def test_offline_audio_equals_the_direct_engine_through_our_codec(offline, solo, codec, index):
    profile, audio = offline
    spec = SPEC[index]
    rows, want = direct(solo, codec, spec)
    log_dir = os.environ.get("HIGGS_VLLM_LOG_DIR")
    if log_dir:  # both sides of the comparison, for a look after the GPU run
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        torch.save({"omni": audio[spec["key"]], "direct": want, "direct_rows": rows},
                   Path(log_dir, f"omni_audio_{profile}_{spec['key']}.pt"))  # fmt: skip
    assert_same_audio(audio[spec["key"]], want, f"{profile} {spec['key']}", solo, spec, rows)


def test_the_offline_comparison_fails_against_a_model_off_by_5_percent(offline, codec, ckpt, tmp_path_factory):
    """The mutation test of the comparison above: the same Omni audio against a direct engine whose checkpoint has
    one layer's o_proj scaled by 1.05 must fail it for at least one request (else the near-tie allowance would hide
    a broken model)."""
    profile, audio = offline
    broken = sdpa_talker(broken_checkpoint(ckpt, tmp_path_factory.mktemp("broken") / "ckpt", "o_proj", 1, 1.05))
    caught = []
    for spec in SPEC:
        rows, want = direct(broken, codec, spec)
        try:
            assert_same_audio(audio[spec["key"]], want, f"{profile} {spec['key']}", broken, spec, rows)
        except AssertionError as exc:
            caught.append(f"{spec['key']}: {str(exc).splitlines()[0][:160]}")
    print(f"\n[omni mutation] {profile}: {len(caught)} of {len(SPEC)} requests caught: {caught}")
    assert caught, f"{profile}: o_proj x 1.05 in one layer passed every comparison"


def greedy_spec(key: str, max_tokens: int) -> dict:
    """SPEC's request ``key`` as a batch sends it: greedy, unseeded, ``max_tokens`` long."""
    spec = next(s for s in SPEC if s["key"] == key) | {"temperature": 0.0, "max_tokens": max_tokens}
    spec.pop("seed", None)
    return spec


@pytest.mark.parametrize("key", BATCH["keys"])
def test_requests_batched_in_stage_0_each_get_their_own_audio(offline, solo, codec, key):
    """The BATCH requests, decoded side by side in one Stage-0 batch (slots, feedback, each request's published
    row), each give the audio the direct engine gives that request alone (greedy, the batch's length)."""
    profile, audio = offline
    spec = greedy_spec(key, BATCH["max_tokens"])
    rows, want = direct(solo, codec, spec)
    assert_same_audio(audio[f"batched_{key}"], want, f"{profile} batched {key}", solo, spec, rows)


def test_requests_preempted_for_kv_blocks_each_get_their_own_audio(ckpt, solo, codec, tmp_path_factory):
    """Low-latency profile, Stage 0 on SMALL_KV's few KV blocks: vLLM preempts requests of the batch and recomputes
    them from their prompt and generated tokens; the adapter feeds the recomputed positions their rows again, so
    each request's audio is still the direct engine's for that request alone (greedy, the batch's length)."""
    audio = offline_audio(ckpt, "low_latency", tmp_path_factory.mktemp("small_kv"), small_kv=True)
    log = _LOGS["low_latency_small_kv"]
    assert "recomputed after a preemption" in log, "no request was preempted: the KV cache was not small enough"
    for key in SMALL_KV["keys"]:
        spec = greedy_spec(key, SMALL_KV["max_tokens"])
        rows, want = direct(solo, codec, spec)
        assert_same_audio(audio[f"batched_{key}"], want, f"small KV {key}", solo, spec, rows)


# ---------------------------------------------------------------------------------------------------------
# vllm-omni serve


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    yaml_path = derived_yaml(deploy_yaml("ours", "low_latency"), tmp / "low_latency.yaml", STAGES)
    log_dir = Path(os.environ.get("HIGGS_VLLM_LOG_DIR") or tmp)
    log_dir.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(str(ckpt), yaml_path, talker_env("ours"), log_dir / "omni_serve.log", timeout=900)
    try:
        yield {"url": url, "offline": offline_audio(ckpt, "low_latency", tmp)}
    finally:
        stop_server(proc)


def _body(spec: dict, fmt: str) -> dict:
    # the speech API takes no temperature: Stage 0 samples with the profile's defaults, seeded
    return {"input": spec["text"], "response_format": fmt, "stream": True, "seed": spec["seed"],
            "max_new_tokens": spec["max_tokens"]}  # fmt: skip


def _pcm(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.int16).float() / 32768.0


def _wav_samples(data: bytes) -> torch.Tensor:
    """The samples of a (streamed) 16-bit WAV: whatever follows the ``data`` chunk header."""
    at = data.find(b"data")
    assert data[:4] == b"RIFF" and at > 0, data[:64]
    return _pcm(data[at + 8 :])


def assert_pcm_matches(got: torch.Tensor, offline: torch.Tensor, what: str) -> None:
    assert got.numel() == offline.numel(), f"{what}: {got.numel()} samples, offline {offline.numel()}"
    want = offline.clamp(-1.0, 1.0)
    diff = float((got - want).abs().max())
    assert diff <= 3 / 32768 + 1e-3 * float(want.abs().max()), f"{what}: max |diff| {diff:.3g} against offline"


def test_openai_client_speech_equals_offline(server):
    openai = pytest.importorskip("openai")
    spec = next(s for s in SPEC if s["key"] == "deploy")
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused")
    response = client.audio.speech.create(
        model="higgs", voice="alloy", input=spec["text"], response_format="pcm",
        extra_body={"voice": None, "seed": spec["seed"], "max_new_tokens": spec["max_tokens"]},
    )  # fmt: skip
    assert_pcm_matches(_pcm(response.content), server["offline"]["deploy"], "openai pcm")


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_httpx_streaming_equals_offline(server, fmt):
    import httpx

    spec = next(s for s in SPEC if s["key"] == "deploy")
    data, chunks = b"", 0
    with httpx.stream("POST", server["url"] + "/v1/audio/speech", json=_body(spec, fmt), timeout=300) as r:
        assert r.status_code == 200, r.read()[:500]
        for chunk in r.iter_raw():
            data += chunk
            chunks += bool(chunk)
    got = _pcm(data) if fmt == "pcm" else _wav_samples(data)
    assert chunks > 1, "the audio came in one piece: not streamed"
    assert_pcm_matches(got, server["offline"]["deploy"], f"httpx {fmt}")


def test_a_client_that_leaves_mid_stream_frees_its_request(server):
    import httpx

    long = {"text": "A long request that the client abandons after its first audio.", "seed": 1, "max_tokens": 900}
    with httpx.stream("POST", server["url"] + "/v1/audio/speech", json=_body(long, "pcm"), timeout=300) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # the first audio, then the connection closes
    spec = next(s for s in SPEC if s["key"] == "deploy")
    r = httpx.post(server["url"] + "/v1/audio/speech", json=_body(spec, "pcm") | {"stream": False}, timeout=120)
    assert r.status_code == 200, r.text[:500]
    assert_pcm_matches(_pcm(r.content), server["offline"]["deploy"], "after a disconnect")


@pytest.mark.parametrize(
    "body, word",
    [({"input": "Hello.", "voice": "nobody-uploaded-this"}, "voice"), ({"input": "   "}, "input")],
    ids=["unknown-voice", "empty-input"],
)
def test_a_bad_request_gets_a_4xx_with_a_message(server, body, word):
    import httpx

    r = httpx.post(server["url"] + "/v1/audio/speech", json=body | {"response_format": "pcm"}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert word in r.text.lower(), r.text[:500]
