"""The checkpoint vllm-omni's two stages load (``benchmarks/omni_checkpoint.py``), checked on CPU against vllm-omni's
own Stage-1 code: its ``HiggsAudioV3Code2Wav`` loads the real-layout random codec without a missing or unexpected
key and decodes bit-identically to our codec; its async-chunk stage-input processor fed our direct engine's rows,
then its code2wav, gives the audio of ``HiggsTalker.stream_audio(..., chunking=UPSTREAM_CHUNKING)``; its prompt
builder gives our prompt. vllm-omni's ``Omni`` itself does not import on this CPU venv (torchvision), so the
pipeline end to end is ``test_omni_gpu.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("vllm.config")
pytest.importorskip("vllm_omni")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_omni import PROFILES, read_profile, stage_of  # noqa: E402
from omni_checkpoint import CODEC_SHARD, write_omni_checkpoint  # noqa: E402

from higgs_talker import HiggsTalker, SamplingParams  # noqa: E402
from higgs_talker.checkpoint import CODEC_PREFIX, INDEX_FILE, read_header  # noqa: E402
from higgs_talker.codec import UPSTREAM_CHUNKING  # noqa: E402
from higgs_talker.vllm_plugin.deploy import deploy_config_path  # noqa: E402


def _connector_extra() -> dict:
    """vllm-omni's codec chunk settings: our high-throughput profile's connector, which keeps vllm-omni's (the
    low-latency and full-decode ones cut the left context to the codec's reach)."""
    (connector,) = read_profile(deploy_config_path("high-throughput"))["connectors"].values()
    return connector["extra"]


@pytest.fixture(scope="module")
def omni_ckpt(tmp_path_factory) -> Path:
    return write_omni_checkpoint(tmp_path_factory.mktemp("omni") / "ckpt", shape="tiny")


def _stage1(cls, omni_ckpt: Path):
    """A Stage-1 module of ``cls`` with the checkpoint's weights, fed as vLLM's loader feeds them (the index's
    shards, every key)."""
    from safetensors import safe_open
    from vllm_omni.transformers_utils.configs.higgs_audio_v3 import HiggsAudioV3Config

    files = sorted(set(json.loads((omni_ckpt / INDEX_FILE).read_text())["weight_map"].values()))

    def weights():
        for name in files:
            with safe_open(str(omni_ckpt / name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield key, f.get_tensor(key)

    module = cls(HiggsAudioV3Config.from_pretrained(str(omni_ckpt)))
    module.load_weights(weights(), device=torch.device("cpu"))  # raises on a missing or unexpected decoder key
    return module


@pytest.fixture(scope="module")
def code2wav(omni_ckpt):
    """vllm-omni's own Stage-1 module."""
    from vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_code2wav import HiggsAudioV3Code2Wav

    return _stage1(HiggsAudioV3Code2Wav, omni_ckpt)


@pytest.fixture
def no_capture_check(monkeypatch):
    """vllm-omni's code check asks CUDA whether a graph is being captured, which raises on CPU-only torch."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_the_index_names_every_key_and_the_codec_has_its_own_shard(omni_ckpt):
    weight_map = json.loads((omni_ckpt / INDEX_FILE).read_text())["weight_map"]
    header = read_header(sorted(omni_ckpt.glob("*.safetensors")))
    assert set(weight_map) == set(header)
    assert all(header[k][0].name == f for k, f in weight_map.items())
    codec = {k for k in weight_map if k.startswith(CODEC_PREFIX)}
    assert codec == {k for k, f in weight_map.items() if f == CODEC_SHARD}
    assert f"{CODEC_PREFIX}quantizer.quantizers.7.codebook.embed" in codec
    assert header[f"{CODEC_PREFIX}fc2.weight"][1:] == ((256, 1024), "BF16")
    assert not (omni_ckpt / "codec_config.json").exists()  # would describe the tiny codec, not this one


def test_vllm_omni_code2wav_loads_the_codec_and_decodes_like_ours(code2wav, omni_ckpt, no_capture_check):
    from higgs_talker.codec import Codec

    assert code2wav._loaded and code2wav.quantizer is not None
    codes = torch.randint(0, 1024, (1, 8, 24), generator=torch.Generator().manual_seed(0))
    theirs = code2wav.decode_codes(codes)[0, 0]
    ours = Codec.from_pretrained(omni_ckpt).decode(codes[0].t().contiguous())
    assert theirs.shape == ours.shape == (24 * 960,)
    assert torch.equal(theirs, ours)  # float32 both, same modules and order of operations
    assert ours.abs().max() > 1e-3  # random weights, not a silent decoder


def _stage1_step(module, chunks: list[torch.Tensor], metas: list[dict]) -> list[torch.Tensor]:
    """One Stage-1 step as vllm-omni's runner calls it: every request's codes [8, T] flattened into one id row,
    their counts, and each request's trims in its info dict."""
    ids = torch.cat([c.reshape(-1) for c in chunks])
    infos = [{"meta": m} for m in metas]
    out = module.forward(ids, None, seq_token_counts=[c.numel() for c in chunks], runtime_additional_information=infos)
    return out.multimodal_outputs["model_outputs"]


def test_our_stage_1_decodes_a_steps_chunks_together_with_vllm_omnis_audio(
    code2wav, omni_ckpt, no_capture_check, monkeypatch
):
    """Our Stage 1 (``HiggsTalkerCode2Wav``): the chunks of one length decode as one batch (two decoder calls for four
    requests of two lengths, where vllm-omni's makes four), each request's audio equal to vllm-omni's to float rounding
    with its own trims; a request with a code out of range gets vllm-omni's empty audio (its batch falls back to one
    decode a chunk) and the others theirs; a chunk whose shape or place in the step's ids is not the one the batch
    decoded is decoded alone."""
    from vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_code2wav import HiggsAudioV3Code2Wav

    from higgs_talker.codec.codec import DecodedAhead
    from higgs_talker.vllm_plugin.code2wav import HiggsTalkerCode2Wav

    g = torch.Generator().manual_seed(3)
    chunks = [torch.randint(0, 1024, (8, t), generator=g) for t in (54, 30, 54, 54)]
    metas = [{"left_context_size": 25, "right_holdback_size": 4}, {"right_holdback_size": 4},
             {"left_context_size": 25, "right_holdback_size": 4}, {}]  # fmt: skip
    calls = []
    parent = HiggsAudioV3Code2Wav.decode_codes
    monkeypatch.setattr(
        HiggsAudioV3Code2Wav, "decode_codes", lambda self, c: calls.append(c.shape[0]) or parent(self, c)
    )
    ours = _stage1(HiggsTalkerCode2Wav, omni_ckpt)
    want = _stage1_step(code2wav, chunks, metas)
    assert calls == [1, 1, 1, 1]
    calls.clear()
    got = _stage1_step(ours, chunks, metas)
    assert sorted(calls) == [1, 3]  # one batch a length
    assert [w.numel() for w in got] == [w.numel() for w in want] == [25 * 960, 26 * 960, 25 * 960, 54 * 960]
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), float((a - b).abs().max())
    assert ours._ahead is None  # nothing left over for the next step
    bad = [c.clone() for c in chunks]
    bad[2][0, 5] = 1024  # out of range
    calls.clear()
    got = _stage1_step(ours, bad, metas)
    assert sorted(calls) == [1, 1, 1, 1, 3]  # the batch of one, the failed batch of three, then each of these alone
    want = _stage1_step(code2wav, bad, metas)
    assert got[2].numel() == want[2].numel() == 0
    for i in (0, 1, 3):
        assert (got[i] - want[i]).abs().max() <= 1e-5 * want[i].abs().max()

    # vllm-omni's loop asking for a chunk the step did not decode (a later vllm-omni splitting otherwise): decoded alone
    def silence(batch):
        return torch.zeros(batch.shape[0], 1, batch.shape[-1] * 960)

    ours._ahead = DecodedAhead(silence, [chunks[1][None], chunks[0][None]])
    alone = ours.decode_codes(chunks[0][None])
    assert ours._ahead.take(chunks[0][None]) is None  # the rest is dropped too: the list is out of step
    assert torch.equal(alone, code2wav.decode_codes(chunks[0][None]))
    flat = torch.cat([chunks[0].reshape(-1), chunks[2].reshape(-1)])  # two chunks of one shape, at other places
    first, second = flat[: chunks[0].numel()].reshape(1, 8, 54), flat[chunks[0].numel() :].reshape(1, 8, 54)
    ours._ahead = DecodedAhead(silence, [second])
    assert torch.equal(ours.decode_codes(first), code2wav.decode_codes(first))


def test_our_stage_1_replays_graphs_of_the_windows_its_yaml_names_after_one_range_check_a_batch(
    code2wav, omni_ckpt, no_capture_check, monkeypatch
):
    """Our Stage 1 with graphs of its windows (here a stand-in capture whose replays, like a CUDA graph's, run no
    range check; on CUDA ``load_weights`` captures the lengths Stage 1's ``hf_overrides`` names): each length's
    batch replays one graph and every request's audio is vllm-omni's to float rounding; a code out of range is
    caught before any replay (only its request gets empty audio; replayed unchecked, it would index past the
    codebook and fail the whole step)."""
    import itertools
    from functools import partial

    from _stand_in_graphs import stand_in_capture
    from vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_code2wav import HiggsAudioV3Code2Wav

    from higgs_talker.cuda_graphs.codec import CodecGraphs
    from higgs_talker.vllm_plugin import CODEC_GRAPH_FRAMES
    from higgs_talker.vllm_plugin.code2wav import HiggsTalkerCode2Wav

    ours = _stage1(HiggsTalkerCode2Wav, omni_ckpt)
    overrides = {CODEC_GRAPH_FRAMES: [30, 54]}
    ours.vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_overrides=overrides, enforce_eager=False))
    assert ours.graph_frames() == []  # vLLM captures graphs of its own: ours stay out
    ours.vllm_config.model_config.enforce_eager = True
    assert ours.graph_frames() == [30, 54] and ours._graphs is None  # on CPU load_weights captures nothing
    replays = []

    def capture(fn, pool=None, mode="global"):
        def replay():
            replays.append(1)
            with monkeypatch.context() as m:
                m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
                return fn()

        graph, out = stand_in_capture(replay, pool)
        # vllm-omni's decode_codes runs in inference mode, so its output is an inference tensor, which a CUDA graph's
        # replay overwrites directly, and the stand-in's copy only inside inference mode
        graph.replay = torch.inference_mode()(graph.replay)
        return graph, out

    times = itertools.cycle([1.0, 0.0])  # eager timed first, then the graph: every graph is kept
    ours._graphs = CodecGraphs(partial(HiggsAudioV3Code2Wav.decode_codes, ours), 8, 1024, torch.device("cpu"),
                               capture=capture, timer=lambda fn: next(times))  # fmt: skip
    ours._graphs.capture(ours.graph_frames())
    assert ours._graphs.captured == [(b, t) for b in (1, 2, 4, 8) for t in (30, 54)]
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randint(0, 1024, (8, t), generator=g) for t in (54, 30, 54, 54)]
    metas = [{"left_context_size": 25, "right_holdback_size": 4}, {"right_holdback_size": 4},
             {"left_context_size": 25, "right_holdback_size": 4}, {}]  # fmt: skip
    replays.clear()
    got, want = _stage1_step(ours, chunks, metas), _stage1_step(code2wav, chunks, metas)
    assert len(replays) == 2  # the three 54-frame chunks in the 4-window graph, the 30-frame one alone
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-5 * b.abs().max()
    bad = [c.clone() for c in chunks]
    bad[2][0, 5] = 1024
    replays.clear()
    got, want = _stage1_step(ours, bad, metas), _stage1_step(code2wav, bad, metas)
    assert len(replays) == 1 and got[2].numel() == want[2].numel() == 0
    for i in (0, 1, 3):
        assert (got[i] - want[i]).abs().max() <= 1e-5 * want[i].abs().max()


def test_the_our_stage1_profiles_name_the_windows_of_their_own_chunking(tmp_path):
    """``bench_omni``'s ``..._our_stage1`` profiles ask Stage 1 for graphs of exactly the window lengths their
    connector's chunking decodes (the first ones and the steady one)."""
    from bench_omni import profile_yaml
    from test_omni_gpu import chunking_of

    from higgs_talker.codec.streaming import window_lengths
    from higgs_talker.vllm_plugin import CODEC_GRAPH_FRAMES

    path = profile_yaml("ours", "full_decode_64_async_frame_graphs_our_stage1", tmp_path)
    stage1 = stage_of(path, 1)
    want = window_lengths(chunking_of(path).resolved((10, 10)))
    assert stage1["hf_overrides"][CODEC_GRAPH_FRAMES] == want == [5, 30, 39]


def test_our_stage_1_decodes_alone_what_runs_out_of_memory_as_a_batch(
    code2wav, omni_ckpt, no_capture_check, monkeypatch
):
    """A batch that runs out of device memory is not the step's failure: its chunks decode one by one, as vllm-omni's
    own loop decodes them, with the same audio."""
    from vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_code2wav import HiggsAudioV3Code2Wav

    from higgs_talker.vllm_plugin.code2wav import HiggsTalkerCode2Wav

    parent = HiggsAudioV3Code2Wav.decode_codes

    def small_memory(self, codes):
        if codes.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (a batch of several chunks)")
        return parent(self, codes)

    monkeypatch.setattr(HiggsAudioV3Code2Wav, "decode_codes", small_memory)
    g = torch.Generator().manual_seed(4)
    chunks = [torch.randint(0, 1024, (8, 30), generator=g) for _ in range(3)]
    metas = [{"right_holdback_size": 4}] * 3
    got, want = (
        _stage1_step(_stage1(HiggsTalkerCode2Wav, omni_ckpt), chunks, metas),
        _stage1_step(code2wav, chunks, metas),
    )
    assert [w.numel() for w in got] == [w.numel() for w in want] == [26 * 960] * 3
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)  # each decoded alone, as vllm-omni's


def test_the_our_stage1_profiles_run_our_stage_1_with_the_codecs_reach_of_context(tmp_path):
    """``bench_omni.py``'s ``..._our_stage1`` profiles: ours is its base profile with our Stage 1's architecture and
    graphs of its windows on stage 1 (registered by the plugin: test_registration.py) and the codec's reach of left
    context on the connector, nothing else changed; vllm-omni's talker, whose processes do not load our plugin, runs
    the base profile."""
    from bench_omni import CODEC_ARCH, CODEC_REACH, STAGE1_WINDOWS, profile_yaml, upstream_profile

    from higgs_talker.vllm_plugin import CODEC_GRAPH_FRAMES

    base = "full_decode_64_async_frame_graphs"
    plain, ours = (read_profile(profile_yaml("ours", p, tmp_path)) for p in (base, f"{base}_our_stage1"))
    assert ours["stages"][1].pop("model_arch") == CODEC_ARCH
    assert ours["stages"][1].pop("hf_overrides") == {CODEC_GRAPH_FRAMES: STAGE1_WINDOWS}
    assert "hf_overrides" not in plain["stages"][1]
    for name, connector in ours["connectors"].items():
        assert connector["extra"]["codec_left_context_frames"] == CODEC_REACH
        connector["extra"]["codec_left_context_frames"] = plain["connectors"][name]["extra"][
            "codec_left_context_frames"
        ]
    assert ours == plain
    assert upstream_profile(base + "_our_stage1") == "full_decode_64_async"
    assert upstream_profile("full_decode_64_async_our_stage1") == "full_decode_64_async"
    # the context alone (..._reach_context), which vllm-omni's talker runs too
    for talker in ("ours", "upstream"):
        plain, reach = (read_profile(profile_yaml(talker, p, tmp_path))
                        for p in ("full_decode_64_async", "full_decode_64_async_reach_context"))  # fmt: skip
        for name, connector in reach["connectors"].items():
            assert connector["extra"].pop("codec_left_context_frames") == CODEC_REACH
            plain["connectors"][name]["extra"].pop("codec_left_context_frames")
        assert reach == plain, talker
    assert upstream_profile(base + "_reach_context") == "full_decode_64_async_reach_context"


def test_derived_yaml_refuses_connector_settings_where_there_is_no_connector(tmp_path):
    """A connector setting asked of a YAML without connectors (or ``connectors: null``) is an error naming the
    setting, not a YAML silently without it; without such a setting, ``connectors: null`` is fine."""
    from bench_omni import CONNECTORS, derived_yaml

    for text in ("stages:\n  - stage_id: 0\n", "connectors: null\nstages:\n  - stage_id: 0\n"):
        base = tmp_path / "base.yaml"
        base.write_text(text)
        with pytest.raises(ValueError, match="codec_left_context_frames"):
            derived_yaml(base, tmp_path / "out.yaml", {CONNECTORS: {"codec_left_context_frames": 10}})
        derived_yaml(base, tmp_path / "out.yaml", {0: {"max_num_seqs": 4}})
        assert "max_num_seqs: 4" in (tmp_path / "out.yaml").read_text()


def test_the_codecs_reach_of_left_context_gives_vllm_omnis_audio_and_one_frame_less_does_not(
    code2wav, no_capture_check
):
    """The real codec's decoder reaches ``CODEC_REACH`` frames back (``decoder_reach``, the 4B codec's config and the
    test checkpoint's vllm-omni decoder alike): vllm-omni's hand-over + code2wav with that much left context give the
    audio of its 25 frames (the profiles'), to float32 rounding, from 39 decoded frames a chunk instead of 54; one
    frame less changes it."""
    from bench_omni import CODEC_REACH

    from higgs_talker.codec import HIGGS_V3_CODEC, build_config
    from higgs_talker.codec.model import CodecModel, decoder_reach
    from higgs_talker.heads.delay import apply_delay_pattern

    assert (
        decoder_reach(CodecModel(build_config(HIGGS_V3_CODEC), encoder=False).acoustic_decoder, 960)[0] == CODEC_REACH
    )
    assert decoder_reach(code2wav.acoustic_decoder, 960)[0] == CODEC_REACH
    frames = torch.randint(0, 1024, (90, 8), generator=torch.Generator().manual_seed(5))
    rows = apply_delay_pattern(frames, 1024, 1025)
    extra = _connector_extra()
    assert extra["codec_left_context_frames"] == 25

    def audio(left: int) -> torch.Tensor:
        return torch.cat(_upstream_stream(code2wav, rows, extra=extra | {"codec_left_context_frames": left}))

    stock = audio(25)
    peak = float(stock.abs().max())
    assert stock.numel() == 89 * 960 and peak > 1e-3
    # float32 rounding of the decoder's convolutions over other lengths: 1.3e-6 of peak seen; one frame less, 3.5e-4
    assert float((audio(CODEC_REACH) - stock).abs().max()) <= 2e-5 * peak
    assert float((audio(CODEC_REACH - 1) - stock).abs().max()) > 2e-5 * peak


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to TF32's 10 mantissa bits, to nearest, as TF32 tensor cores read their inputs."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def _decode_in_tf32(codec, codes: torch.Tensor) -> torch.Tensor:
    """``codec.decode(codes)`` with every convolution of its decoder reading TF32-rounded inputs and weights, products
    summed in float32: what cuDNN's TF32 convolutions compute, on the CPU."""
    convs = [m for m in codec.model.acoustic_decoder.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    weights = [conv.weight.data for conv in convs]
    hooks = [conv.register_forward_pre_hook(lambda _, args: (_tf32(args[0]), *args[1:])) for conv in convs]
    try:
        for conv, weight in zip(convs, weights, strict=True):
            conv.weight.data = _tf32(weight)
        return codec.decode(codes)
    finally:
        for conv, weight, hook in zip(convs, weights, hooks, strict=True):
            conv.weight.data = weight
            hook.remove()


def test_the_batched_decode_bound_holds_tf32_rounding_and_not_a_decoder_1_percent_off(omni_ckpt):
    """test_omni_gpu's ``batched_decode_bound`` (how far a chunk our Stage 1 decoded in a batch may be from a lone
    decode, both in cuDNN's TF32) on the real-layout codec: a decode in emulated TF32 stays within half of it of the
    float32 decode (one decode's share: 2.1e-3 of the peak seen, against 3.0e-3), and a decoder whose last
    convolution is 1 % off does not stay within all of it (9.2e-3 against 5.9e-3)."""
    from test_omni_gpu import batched_decode_bound

    from higgs_talker.codec import Codec

    codec = Codec.from_pretrained(omni_ckpt, device="cpu")
    bound = batched_decode_bound(codec)
    assert 5e-3 < bound < 7e-3  # 37 convolutions: 2 * sqrt(37) * 2**-11
    codes = torch.randint(0, 1024, (39, 8), generator=torch.Generator().manual_seed(9))
    exact = codec.decode(codes)
    peak = float(exact.abs().max())
    assert 0 < float((_decode_in_tf32(codec, codes) - exact).abs().max()) <= bound / 2 * peak
    last = [m for m in codec.model.acoustic_decoder.modules() if isinstance(m, nn.Conv1d)][-1]
    weight = last.weight.data
    try:
        last.weight.data = weight * 1.01
        assert float((codec.decode(codes) - exact).abs().max()) > bound * peak
    finally:
        last.weight.data = weight


@pytest.mark.parametrize("talker", ["ours", "upstream"])
def test_vllm_omni_low_latency_is_vllm_omnis_low_latency_yaml(talker, tmp_path):
    """bench_omni's ``vllm_omni_low_latency`` (the base of its low_latency_* and full_decode_64* profiles), derived
    from each talker's high-throughput YAML: for vllm-omni's talker it loads equal to vllm-omni's own low-latency
    YAML; ours differs from it only where our high-throughput YAML differs from vllm-omni's (our Stage-0
    architecture, the connector's name, no pinned seed)."""
    from bench_omni import deploy_yaml, profile_yaml
    from vllm_omni.config.stage_config import load_deploy_config

    derived = profile_yaml(talker, "vllm_omni_low_latency", tmp_path)
    if talker == "upstream":
        assert load_deploy_config(derived) == load_deploy_config(deploy_yaml("upstream", "low_latency"))
        return
    ours, theirs = (read_profile(p) for p in (derived, deploy_yaml("upstream", "low_latency")))
    (our_name,), (their_name,) = ours["connectors"], theirs["connectors"]
    assert ours["connectors"][our_name] == theirs["connectors"][their_name]
    for mine, other in zip(ours["stages"], theirs["stages"], strict=True):
        for stage in (mine, other):  # each file names its connector its own way (compared above)
            stage.pop("output_connectors", None)
            stage.pop("input_connectors", None)
        other["default_sampling_params"].pop("seed")
        arch = mine.pop("model_arch", None)
        assert arch == ("HiggsTalkerForConditionalGeneration" if mine["stage_id"] == 0 else None)
        assert mine == other


def test_the_expected_audio_is_decoded_with_the_chunking_each_profile_asks_for(tmp_path):
    """test_omni_gpu's ``chunking_of`` (what its expected audio is decoded with) reads a profile's connector as
    vllm-omni's hand-over does: vllm-omni's shape of profile asks for its own chunking, ``..._our_stage1`` and the
    packaged profiles that run our Stage 1 for the codec's reach of left context."""
    from bench_omni import CODEC_REACH, profile_yaml
    from test_omni_gpu import chunking_of

    from higgs_talker.codec import AudioChunking

    for profile in ("vllm_omni_low_latency", "high_throughput"):
        assert chunking_of(profile_yaml("ours", profile, tmp_path)) == UPSTREAM_CHUNKING, profile
    reach = AudioChunking(
        chunk_frames=25, first_chunk_frames=1, left_context_frames=CODEC_REACH, holdback_frames=4, ramp=False
    )
    for profile in ("full_decode_64_async_frame_graphs_our_stage1", "low_latency", "full_decode"):
        assert chunking_of(profile_yaml("ours", profile, tmp_path)) == reach, profile


@pytest.mark.parametrize("profile", PROFILES)
def test_the_gpu_tests_read_which_stage_1_each_profile_runs(profile, tmp_path):
    """test_omni_gpu's ``stage1_arch`` (which picks the batched-decode bound and the Stage-1 log checks) reads our
    Stage 1 exactly from the YAMLs of the profiles built on it (``_our_stage1`` in the name, ``..._our_stage1_ramp``
    too, which a check by the name's end missed) and of the packaged low-latency profile, and None from the others,
    whose Stage 1 names no architecture (vLLM takes the checkpoint's: vllm-omni's code2wav)."""
    from bench_omni import CODEC_ARCH, derived_yaml, profile_yaml
    from test_omni_gpu import STAGES, stage1_arch

    yaml_path = derived_yaml(profile_yaml("ours", profile, tmp_path), tmp_path / f"{profile}.yaml", STAGES)
    ours = "_our_stage1" in profile or profile == "low_latency"
    assert stage1_arch(yaml_path) == (CODEC_ARCH if ours else None)


def test_our_prompt_equals_vllm_omnis(omni_ckpt):
    from transformers import AutoTokenizer
    from vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_tokenizer import HiggsAudioV3TokenizerAdapter

    from higgs_talker.config import TalkerConfig
    from higgs_talker.prompt import TalkerTokenizer

    adapter = HiggsAudioV3TokenizerAdapter(AutoTokenizer.from_pretrained(str(omni_ckpt)))
    ours = TalkerTokenizer.from_pretrained(omni_ckpt, TalkerConfig.from_pretrained(omni_ckpt))
    for text in ("Hello there.", "A longer sentence, with a comma; and more words."):
        assert list(adapter.build_prompt(text)) == ours.build(text).input_ids.tolist()


def _upstream_stream(
    code2wav, rows: torch.Tensor, processor=None, late: bool = False, ended: str = "FINISHED_STOPPED", extra=None
) -> list[torch.Tensor]:
    """vllm-omni's Stage-0 -> Stage-1 hand-over on ``rows`` [N, 8] (one row per step, the last with the finish),
    each chunk decoded by its code2wav with the trims the chunk's meta asks for. ``processor``: the hand-over
    (default vllm-omni's); ``late``: the next-to-last step's call runs after the request finished (queued before,
    so told not finished: vLLM's async scheduling past an EOS, as seen on the H200); ``ended``: the request's status
    once finished (vLLM's ``RequestStatus`` name); ``extra``: the connector's chunk settings (default the profiles')."""
    from vllm_omni.model_executor.stage_input_processors.higgs_audio_v3 import talker2code2wav_async_chunk

    processor = processor or talker2code2wav_async_chunk
    connector = SimpleNamespace(config={"extra": extra or _connector_extra()})
    manager = SimpleNamespace(code_prompt_token_ids={"r": []}, connector=connector)
    chunks = []
    for i, row in enumerate(rows):
        last, done = i == len(rows) - 1, i >= len(rows) - (2 if late else 1)
        status = SimpleNamespace(name=ended if done else "RUNNING")
        request = SimpleNamespace(external_req_id="r", is_finished=lambda done=done: done, status=status)
        payload = processor(manager, {"codes": {"audio": row[None]}}, request, is_finished=last)
        if payload is None or payload.codes.audio.numel() == 0:
            continue
        codes = payload.codes.audio.reshape(8, -1)[None]
        left, right = payload.meta.left_context_size or 0, payload.meta.right_holdback_size or 0
        chunks.append(code2wav.forward_chunk(codes, left_context_size=left, right_holdback_size=right)[0, 0])
    return chunks


@pytest.mark.parametrize("frames", [3, 33])
def test_vllm_omnis_chunked_hand_over_gives_our_upstream_chunking_audio(code2wav, omni_ckpt, no_capture_check, frames):
    """Our rows through vllm-omni's async-chunk processor and code2wav = our ``stream_audio`` with its schedule."""
    talker = HiggsTalker.from_pretrained(omni_ckpt, max_num_seqs=2, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_frames=frames)
    result = talker.generate("Hello there, streaming.", params)
    assert result.codes.shape == (frames, 8)  # the EOC is pushed down: the cap sets the length
    theirs = _upstream_stream(code2wav, result.rows.long())
    ours = list(talker.stream_audio("Hello there, streaming.", params, chunking=UPSTREAM_CHUNKING))
    assert [c.numel() for c in theirs] == [c.numel() for c in ours]
    assert torch.equal(torch.cat(theirs), torch.cat(ours))
    # the same with the codec's reach of left context (bench_omni's ..._our_stage1 connector; test_omni_gpu's
    # expected audio decodes with it)
    from bench_omni import CODEC_REACH

    reach = dataclasses.replace(UPSTREAM_CHUNKING, left_context_frames=CODEC_REACH)
    theirs = _upstream_stream(code2wav, result.rows.long(), extra=_connector_extra() | {"codec_left_context_frames":
                              CODEC_REACH})  # fmt: skip
    ours = list(talker.stream_audio("Hello there, streaming.", params, chunking=reach))
    assert [c.numel() for c in theirs] == [c.numel() for c in ours]
    assert torch.equal(torch.cat(theirs), torch.cat(ours))


def test_our_hand_over_sends_each_row_once_when_a_step_is_handed_over_after_the_finish(code2wav, omni_ckpt,
                                                                                       no_capture_check):  # fmt: skip
    """``deploy.talker2code2wav_async_chunk`` (vllm-omni's hand-over told only the flag its call was queued with):
    the same audio whether or not the next-to-last step's call runs after the request finished; vllm-omni's own
    hands the frames on twice then (the doubled audio of an EOS-ended request under async scheduling)."""
    from higgs_talker.vllm_plugin.deploy import talker2code2wav_async_chunk as ours

    talker = HiggsTalker.from_pretrained(omni_ckpt, max_num_seqs=2, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_frames=40)
    rows = talker.generate("Hello there, streaming.", params).rows.long()
    want = torch.cat(list(talker.stream_audio("Hello there, streaming.", params, chunking=UPSTREAM_CHUNKING)))
    for late in (False, True):
        assert torch.equal(torch.cat(_upstream_stream(code2wav, rows, ours, late=late)), want), late
    theirs = torch.cat(_upstream_stream(code2wav, rows, late=True))
    assert theirs.numel() > want.numel(), "vllm-omni's own hand-over no longer doubles: the wrapper can go"
    # a request aborted after the call was queued gets no last call of its own: the live status counts, as upstream
    aborted = [torch.cat(_upstream_stream(code2wav, rows, p, True, "FINISHED_ABORTED")) for p in (ours, None)]
    assert torch.equal(aborted[0], aborted[1])


@pytest.mark.parametrize("frames", [2, 40, 97])
def test_our_hand_over_ramps_the_chunks_where_the_connector_asks(code2wav, omni_ckpt, no_capture_check, frames):
    """With the connector's ``codec_chunk_ramp``, our hand-over cuts vllm-omni's windows as our ramped chunking does
    (each chunk as long as the frames sent before it): the same chunks, sample for sample, as ``stream_audio`` with
    vllm-omni's chunking ramped; without the key, vllm-omni's chunks (1, then 25 frames)."""
    from higgs_talker.vllm_plugin.deploy import RAMP_KEY
    from higgs_talker.vllm_plugin.deploy import talker2code2wav_async_chunk as ours

    talker = HiggsTalker.from_pretrained(omni_ckpt, max_num_seqs=2, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_frames=frames)
    rows = talker.generate("Hello there, ramped streaming.", params).rows.long()
    ramped = _upstream_stream(code2wav, rows, ours, extra=_connector_extra() | {RAMP_KEY: True})
    rule = dataclasses.replace(UPSTREAM_CHUNKING, ramp=True)
    want = list(talker.stream_audio("Hello there, ramped streaming.", params, chunking=rule))
    assert [c.numel() for c in ramped] == [c.numel() for c in want]
    assert torch.equal(torch.cat(ramped), torch.cat(want))
    flat, hop = _upstream_stream(code2wav, rows, ours), talker.cfg.sample_rate // talker.cfg.frame_rate
    if frames > 5:  # shorter: one chunk at the end, ramped or not
        assert [c.numel() // hop for c in flat][:1] == [1] and all(c.numel() == 25 * hop for c in flat[1:-1])
    if frames > 40:
        assert [c.numel() // hop for c in ramped][:6] == [1, 1, 2, 4, 8, 16] and len(ramped) > len(flat)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("talker", ["ours", "upstream"])
def test_bench_omnis_deploy_yamls_and_their_test_variants_parse(talker, profile, tmp_path):
    """bench_omni's YAML of each talker and profile (the packaged ones, and those derived from the low-latency
    one: 64 streams, FULL decode graphs up to 64), and the test suite's variant of it (stage keys replaced),
    through vllm-omni's own loader."""
    from bench_omni import derived_yaml, profile_yaml
    from vllm_omni.config.stage_config import load_deploy_config

    base = profile_yaml(talker, profile, tmp_path)
    if profile.startswith("full_decode_64"):
        stage0 = next(s for s in load_deploy_config(base).stages if s.stage_id == 0)
        graphs = stage0.compilation_config
        assert stage0.max_num_seqs == 64 and not stage0.enforce_eager and graphs["cudagraph_mode"] == "FULL_DECODE_ONLY"
        assert max(graphs["cudagraph_capture_sizes"]) == 64
        caching = (stage0.engine_extras or {}).get("enable_prefix_caching")
        assert caching is not None and bool(caching) == ("_no_prefix_cache" not in profile), caching
    if profile == "low_latency_async":
        stage0 = next(s for s in load_deploy_config(base).stages if s.stage_id == 0)
        assert stage0.async_scheduling is True and not stage0.enforce_eager
    if "frame_graphs" in profile:
        stage0 = next(s for s in load_deploy_config(base).stages if s.stage_id == 0)
        overrides = getattr(stage0, "hf_overrides", None) or (stage0.engine_extras or {}).get("hf_overrides")
        asked = {"higgs_row_linears": True} if profile.endswith("_row_linears") else {}  # row_linear_op.ASK_KEY
        assert overrides == {"higgs_frame_graphs": True} | asked, overrides
        assert stage0.enforce_eager is profile.startswith("high_throughput")  # the eager profile stays eager
    if profile == "low_latency_async_frame_graphs":  # as vllm-omni merges it with its Higgs pipeline
        from vllm_omni.config.stage_config import merge_pipeline_deploy
        from vllm_omni.model_executor.models.higgs_audio_v3.pipeline import HIGGS_AUDIO_V3_PIPELINE

        stage0 = merge_pipeline_deploy(HIGGS_AUDIO_V3_PIPELINE, load_deploy_config(base))[0]
        args = stage0.yaml_engine_args
        hand_over = "higgs_talker.vllm_plugin.deploy.talker2code2wav_async_chunk"
        assert args["custom_process_next_stage_input_func"] == hand_over
        assert args["async_scheduling"] is True and stage0.scheduler_cls.endswith("OmniARAsyncScheduler")
    if profile.endswith("flash_attn"):  # vLLM's FlashAttention backend, FlashInfer's options gone
        from vllm_omni.config.stage_config import merge_pipeline_deploy
        from vllm_omni.model_executor.models.higgs_audio_v3.pipeline import HIGGS_AUDIO_V3_PIPELINE

        args = merge_pipeline_deploy(HIGGS_AUDIO_V3_PIPELINE, load_deploy_config(base))[0].yaml_engine_args
        assert args["attention_backend"] == "FLASH_ATTN" and "attention_config" not in args, args
    if profile.endswith("_mp"):  # vLLM's multiprocess executor for Stage 0: its runner in a process of its own
        from vllm_omni.config.stage_config import merge_pipeline_deploy
        from vllm_omni.model_executor.models.higgs_audio_v3.pipeline import HIGGS_AUDIO_V3_PIPELINE

        args = merge_pipeline_deploy(HIGGS_AUDIO_V3_PIPELINE, load_deploy_config(base))[0].yaml_engine_args
        assert args["distributed_executor_backend"] == "mp", args
    if profile == "full_decode_64_async_frame_graphs":  # --jit-verbose: vLLM's engine argument reaches Stage 0
        from bench_omni import jit_verbose_yaml
        from vllm_omni.config.stage_config import merge_pipeline_deploy
        from vllm_omni.model_executor.models.higgs_audio_v3.pipeline import HIGGS_AUDIO_V3_PIPELINE

        verbose = load_deploy_config(jit_verbose_yaml(base, tmp_path / "jit.yaml"))
        stages = merge_pipeline_deploy(HIGGS_AUDIO_V3_PIPELINE, verbose)
        assert stages[0].yaml_engine_args["jit_monitor_verbose"] is True
        assert "jit_monitor_verbose" not in stages[1].yaml_engine_args
    if profile.endswith(("_our_stage1", "_reach_context")):  # vllm-omni's loader hands stage 1 its architecture
        from bench_omni import CODEC_ARCH, CODEC_REACH
        from vllm_omni.config.stage_config import merge_pipeline_deploy
        from vllm_omni.model_executor.models.higgs_audio_v3.pipeline import HIGGS_AUDIO_V3_PIPELINE

        loaded = load_deploy_config(base)
        arch = merge_pipeline_deploy(HIGGS_AUDIO_V3_PIPELINE, loaded)[1].yaml_engine_args["model_arch"]
        assert (arch == CODEC_ARCH) == profile.endswith("_our_stage1"), arch
        contexts = {c.get("extra", {}).get("codec_left_context_frames") for c in loaded.connectors.values()}
        assert contexts == {CODEC_REACH}
    derived = derived_yaml(base, tmp_path / "derived.yaml", {0: {"max_model_len": 1024}, 1: {"dtype": "float32"}})
    for path in (base, derived):
        cfg = load_deploy_config(path)
        assert sorted(s.stage_id for s in cfg.stages) == [0, 1] and cfg.async_chunk is True
    text = derived.read_text()
    assert "max_model_len: 1024" in text and "dtype: float32" in text and "base_config" not in text


@pytest.mark.parametrize(
    "text",
    ["Hello world.", "  Hello world.\n", "\n\nPara one.\n\nPara two.\n", "Grüße, 世界! 🎉", "a", "Hi 42 times."],
    ids=["plain", "spaces-newline", "paragraphs", "unicode", "one-letter", "digits"],
)
def test_the_speech_servers_prompt_equals_vllm_omnis(tiny_dir, talker, text):
    """What ``higgs-talker serve`` prompts for a speech request equals vllm-omni's prompt builder's for its input,
    whitespace included (vllm-omni's endpoint tokenizes the input as given; ours stripped it once)."""
    import asyncio

    from transformers import AutoTokenizer
    from vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_tokenizer import HiggsAudioV3TokenizerAdapter

    from higgs_talker.serve.protocol import SpeechRequest
    from higgs_talker.serve.serving import SpeechServing

    upstream = HiggsAudioV3TokenizerAdapter(AutoTokenizer.from_pretrained(str(tiny_dir)))
    job = asyncio.run(SpeechServing(talker).prepare(SpeechRequest(input=text)))
    assert [part.prompt.input_ids.tolist() for part in job.prepared.parts] == [list(upstream.build_prompt(text))]


def test_bench_omni_warms_each_level_up_before_it_times_any(tiny_dir, monkeypatch):
    """bench_omni's offline path: one untimed wave of short requests at every level's size first (vLLM's sampler
    compiles Triton kernels per batch shape), then each level's
    ``level_requests`` forced-length requests in waves of the level's size, with prompts and seeds of their own."""
    import bench_omni
    from vllm.sampling_params import SamplingParams as StageParams

    waves = []

    class RecordingOmni:  # vllm_omni.Omni's offline surface; ``Omni`` itself does not import on this CPU venv
        default_sampling_params_list = [StageParams(), StageParams()]

        def __init__(self, **_) -> None:
            pass

        def generate(self, prompts, params, **_):
            waves.append((len(prompts), params[0].max_tokens, params[0].seed, tuple(map(str, prompts))))
            audio = {"audio": torch.zeros(bench_omni.SAMPLE_RATE // 25)}
            return [
                SimpleNamespace(request_id=str(i), multimodal_output=audio, finished=True) for i in range(len(prompts))
            ]

        def close(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "vllm_omni", SimpleNamespace(Omni=RecordingOmni))
    args = SimpleNamespace(model=str(tiny_dir), yaml="unused.yaml", worker_timeout=1, frames=10, levels=[1, 4], seed=0)
    bench_omni.run_offline(args, {"talker": "ours", "profile": "p"})
    warm, timed = waves[:2], waves[2:]
    assert [(n, rows) for n, rows, *_ in warm] == [(1, bench_omni.WARM_ROWS), (4, bench_omni.WARM_ROWS)]
    want = [(1, 18)] * bench_omni.level_requests(1) + [(4, 18)] * (bench_omni.level_requests(4) // 4)
    assert [(n, rows) for n, rows, *_ in timed] == want and bench_omni.level_requests(1) == 16
    assert not {p for *_, prompts in warm for p in prompts} & {p for *_, prompts in timed for p in prompts}


def test_bench_omni_counts_no_more_audio_than_a_requests_frames_decode_to():
    """vllm-omni's own hand-over under async scheduling sent some requests' audio twice (results/h100_20261206b: 108
    of 192 at 15.88 s where their 200 frames decode to 7.96 s). A level's throughput and RTFs count at most the
    frames' length of each request's audio, and the row says how many sent more and what came."""
    import bench_omni

    normal = {"ttfa_ms": 90.0, "audio_s": 7.96, "rtf": 1.592 / 7.96}
    doubled = {"ttfa_ms": 95.0, "audio_s": 15.88, "rtf": 1.588 / 15.88}  # the same wall time, twice the audio
    row = bench_omni.level_row({"talker": "upstream"}, 2, [normal, doubled], wall=2.0, most_s=200 / 25)
    assert row["audio_s_per_s"] == pytest.approx((7.96 + 8.0) / 2.0)
    assert row["audio_s_per_s_received"] == pytest.approx((7.96 + 15.88) / 2.0)
    assert (row["over_length"], row["audio_s_min"], row["audio_s_max"]) == (1, 7.96, 15.88)
    # both requests took ~1.59 s for their 8 s of audio: RTF ~0.2 each (0.1 for the doubled one if its copy counted)
    assert 1.588 / 8.0 <= row["rtf_p50"] <= 1.592 / 7.96 and 1.588 / 8.0 <= row["rtf_p90"] <= 1.592 / 7.96
    assert row["requests"] == 2 and row["status"] == "ok"


def test_bench_omni_runs_the_upstream_profiles_it_is_given(capsys):
    """``--upstream-profiles`` names what vllm-omni's talker runs (with and without async scheduling, say) beside
    ours; without it, each of ours as vllm-omni's talker runs it; a profile with our own features is refused."""
    import bench_omni

    ours = ["full_decode_64_async_frame_graphs_our_stage1"]
    assert bench_omni.talker_configs("upstream", "http", ours, None) == [("upstream", "full_decode_64_async", "http")]
    given = ["full_decode_64_async", "full_decode_64"]
    assert bench_omni.talker_configs("upstream", "http", ours, given) == [("upstream", p, "http") for p in given]
    assert bench_omni.talker_configs("ours", "http", ours, given) == [("ours", ours[0], "http")]
    with pytest.raises(SystemExit):
        bench_omni.main(["--upstream-profiles", "full_decode_64,full_decode_64_frame_graphs"])
    assert "--upstream-profiles: unknown ['full_decode_64_frame_graphs']" in capsys.readouterr().err


def test_check_stage_0_runs_on_cpu_with_our_engine_standing_in_for_stage_0(omni_ckpt, capsys):
    """test_omni_gpu's check of one Omni request (``check_stage_0``) on CPU: our bf16 engine stands in for Stage 0
    (its sampler's scores recorded as the score probe records Stage 0's, its audio our codec's decode of its rows),
    a float32 talker for the direct engine, whose rows part from the bf16 ones (the parting path: ``explain_parting``),
    and the float32 reference; every request of the GPU test's SPEC passes. A stand-in whose sampler draws the next
    row's noise fails."""
    from _reference_check import ScoreCheck, float32_reference, score_bound
    from test_omni_gpu import SPEC, check_stage_0, decoded, params_of, recorded_run

    from higgs_talker.codec import Codec

    stage_0 = HiggsTalker.from_pretrained(omni_ckpt, dtype="bfloat16", max_num_seqs=1, max_model_len=1024, codec=False)
    direct = HiggsTalker.from_pretrained(omni_ckpt, dtype="float32", max_num_seqs=1, max_model_len=1024, codec=False)
    reference, codec = float32_reference(stage_0), Codec.from_pretrained(omni_ckpt)
    check = ScoreCheck(reference, score_bound(stage_0))
    partings = []
    for spec in SPEC:
        record = recorded_run(stage_0, spec, params_of(spec, stage_0))
        audio = decoded(codec, record["rows"], spec["max_tokens"], stage_0.cfg.num_real_codes)
        check_stage_0(record, spec, direct, reference, codec, audio, check, spec["key"], UPSTREAM_CHUNKING)
        partings += [line for line in capsys.readouterr().out.splitlines() if "parts from the direct engine" in line]
    with capsys.disabled():
        print("\n" + "\n".join(partings))
    assert partings, "no request parted from the float32 talker: the parting path did not run"
    spec = next(s for s in SPEC if s["key"] == "deploy")
    broken = recorded_run(stage_0, spec, params_of(spec, stage_0), step_shift=1)
    audio = decoded(codec, broken["rows"], spec["max_tokens"], stage_0.cfg.num_real_codes)
    with pytest.raises(AssertionError, match="far from the reference's best|not the winner of that run's own race"):
        check_stage_0(broken, spec, direct, reference, codec, audio, check, "next row's noise", UPSTREAM_CHUNKING)
