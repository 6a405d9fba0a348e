"""Deploy profiles: parsed by vllm-omni's own loader, pinning what the profiles promise; the CLI prints them."""

from __future__ import annotations

import pytest

# skips the module cleanly where vLLM is not installed (the core test environment)
pytest.importorskip("vllm.config")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from higgs_talker.vllm_plugin import ARCHITECTURES, CODEC_ARCH, CODEC_GRAPH_FRAMES  # noqa: E402
from higgs_talker.vllm_plugin.deploy import PROFILES, deploy_config_path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_omni import profile_yaml, read_profile  # noqa: E402


def _load(name: str):
    from vllm_omni.config.stage_config import load_deploy_config

    return load_deploy_config(deploy_config_path(name))


def _stage(cfg, stage_id: int):
    (stage,) = [s for s in cfg.stages if s.stage_id == stage_id]
    return stage


def _field(stage, key: str):
    """A stage key, where this vllm-omni keeps it: a field of the stage config or its engine extras."""
    value = getattr(stage, key, None)
    return stage.engine_extras.get(key) if value is None else value


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_profile_parses_and_pins_stage0(name):
    cfg = _load(name)
    assert cfg.async_chunk is True
    assert sorted(s.stage_id for s in cfg.stages) == [0, 1]
    s0, s1 = _stage(cfg, 0), _stage(cfg, 1)
    extras = s0.engine_extras
    assert extras["model_arch"] in ARCHITECTURES
    assert extras["attention_backend"] == "FLASHINFER"
    assert extras["attention_config"] == {"use_trtllm_attention": False}
    for s in (s0, s1):
        assert "seed" not in (s.default_sampling_params or {}), f"stage {s.stage_id} pins a seed"
        assert "seed" not in s.engine_extras
    assert s0.output_connectors and s1.input_connectors
    assert set(s0.output_connectors.values()) <= set(cfg.connectors)


def test_high_throughput_keeps_stage0_eager():
    s0 = _stage(_load("high-throughput"), 0)
    assert s0.enforce_eager is True
    assert not s0.compilation_config


def test_default_is_the_full_decode_profile():
    """The fastest profile measured at every concurrency (docs/serving-vllm.md), not the eager one."""
    default = _load("default")
    assert default == _load("full-decode")
    assert default != _load("high-throughput")


def test_low_latency_uses_vllm_full_decode_graphs():
    s0 = _stage(_load("low-latency"), 0)
    assert s0.enforce_eager is False
    assert s0.compilation_config == {
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16],
        "cudagraph_num_of_warmups": 1,
    }
    assert max(s0.compilation_config["cudagraph_capture_sizes"]) <= s0.max_num_seqs


# packaged profile -> (bench_omni.py's profile it equals, its streams at most, its decode graphs' sizes)
MEASURED_AS = {
    "full-decode": ("full_decode_64_async_frame_graphs_our_stage1", 64, [1, 2, 4, 8, 16, 24, 32, 48, 64]),
    "low-latency": ("low_latency_async_frame_graphs_our_stage1", 16, [1, 2, 4, 8, 16]),
}


@pytest.mark.parametrize("name", list(MEASURED_AS))
def test_packaged_profile_is_the_one_bench_omni_measured(name, tmp_path):
    """The packaged ``full-decode`` and ``low-latency`` YAMLs load equal to ``bench_omni.py``'s profiles of
    ``MEASURED_AS`` (vllm-omni's low-latency YAML with 64 or 16 streams and FULL decode graphs up to that many, async
    scheduling, frame graphs and our hand-over; our Stage 1 with the codec's reach of left context and its windows'
    graphs): the figures in their headers are these files'."""
    from vllm_omni.config.stage_config import load_deploy_config

    profile, streams, sizes = MEASURED_AS[name]
    cfg = _load(name)
    assert cfg == load_deploy_config(profile_yaml("ours", profile, tmp_path))
    s0 = _stage(cfg, 0)
    assert s0.enforce_eager is False and s0.max_num_seqs == streams and _stage(cfg, 1).max_num_seqs == streams
    assert s0.compilation_config["cudagraph_capture_sizes"] == sizes
    assert _field(s0, "async_scheduling") is True
    assert _field(s0, "hf_overrides") == {"higgs_frame_graphs": True}
    hand_over = _field(s0, "custom_process_next_stage_input_func")
    assert hand_over == "higgs_talker.vllm_plugin.deploy.talker2code2wav_async_chunk"
    s1 = _stage(cfg, 1)
    assert _field(s1, "model_arch") == CODEC_ARCH and _field(s1, "hf_overrides") == {CODEC_GRAPH_FRAMES: [5, 30, 39]}


@pytest.mark.parametrize("name", list(PROFILES))
def test_read_profile_reads_each_profile_as_vllm_omni_does(name):
    from vllm_omni.config.stage_config import resolve_deploy_yaml

    assert read_profile(deploy_config_path(name)) == resolve_deploy_yaml(deploy_config_path(name))


def test_low_latency_is_full_decode_with_16_streams():
    """The low-latency YAML names full_decode.yaml as its base_config and changes only the streams and graph sizes."""
    low, full = read_profile(deploy_config_path("low-latency")), read_profile(deploy_config_path("full-decode"))
    for stage in low["stages"]:
        assert stage.pop("max_num_seqs") == 16
        if stage["stage_id"] == 0:
            assert stage.pop("compilation_config")["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16]
    for stage in full["stages"]:
        stage.pop("max_num_seqs")
        if stage["stage_id"] == 0:
            stage.pop("compilation_config")
    assert low == full


def test_read_profile_merges_a_chain_of_base_configs_as_vllm_omni_does(tmp_path):
    """Three files, each the base_config of the next (one in a folder of its own): top-level keys replaced, stages
    overridden key by key by stage_id, the mappings vllm-omni merges key by key merged at every depth (a value that
    is a mapping on one side only replaced), a new stage appended; the same dict as vllm-omni's reader."""
    import yaml
    from vllm_omni.config.stage_config import resolve_deploy_yaml

    sampling = {"temperature": 1.0, "top_k": 50, "nested": {"a": 1, "b": {"c": 2}}}
    root = {
        "async_chunk": True,
        "connectors": {"shm": {"name": "SharedMemoryConnector", "extra": {"codec_chunk_frames": 25, "x": 1}}},
        "stages": [
            {"stage_id": 0, "max_num_seqs": 64, "compilation_config": {"cudagraph_mode": "FULL", "sizes": [1, 2]},
             "default_sampling_params": sampling, "engine_args": {"flat": 1, "tree": {"leaf": 1}}},
            {"stage_id": 1, "max_num_seqs": 64, "default_sampling_params": {"temperature": 0.0}},
        ],
    }  # fmt: skip
    middle = {
        "base_config": "../root.yaml",
        "edges": [{"from": 0, "to": 1}],
        "stages": [
            {"stage_id": 1, "max_num_seqs": 8, "default_sampling_params": {"top_p": 0.9}},
            {"stage_id": 2, "model_arch": "Third", "default_sampling_params": {"temperature": 0.5}},
        ],
    }
    top = {
        "base_config": "sub/middle.yaml",
        "async_chunk": False,
        "stages": [
            {"stage_id": 0, "compilation_config": {"sizes": [1]},
             "default_sampling_params": {"top_k": 20, "nested": {"b": {"d": 3}, "a": {"replaced": True}}},
             "engine_args": {"tree": 7}},
        ],
    }  # fmt: skip
    (tmp_path / "sub").mkdir()
    for path, data in (("root.yaml", root), ("sub/middle.yaml", middle), ("top.yaml", top)):
        (tmp_path / path).write_text(yaml.safe_dump(data, sort_keys=False))
    got = read_profile(tmp_path / "top.yaml")
    assert got == resolve_deploy_yaml(tmp_path / "top.yaml")
    s0, s1, s2 = got["stages"]
    assert s0["compilation_config"] == {"sizes": [1]} and s0["max_num_seqs"] == 64  # replaced whole; kept
    assert s0["default_sampling_params"] == {"temperature": 1.0, "top_k": 20,
                                             "nested": {"a": {"replaced": True}, "b": {"c": 2, "d": 3}}}  # fmt: skip
    assert s0["engine_args"] == {"flat": 1, "tree": 7}
    assert s1 == {"stage_id": 1, "max_num_seqs": 8, "default_sampling_params": {"temperature": 0.0, "top_p": 0.9}}
    assert s2["model_arch"] == "Third" and got["async_chunk"] is False and got["connectors"] == root["connectors"]


def test_read_profile_refuses_what_it_does_not_read(tmp_path):
    """Platform blocks, and over a base_config what vllm-omni's versions merge differently (connectors, pooling)."""
    (tmp_path / "p.yaml").write_text("platforms:\n  rocm:\n    stages: []\nstages: []\n")
    with pytest.raises(ValueError, match="p.yaml has a platforms block"):
        read_profile(tmp_path / "p.yaml")
    (tmp_path / "base.yaml").write_text("connectors: {shm: {name: S}}\nstages: [{stage_id: 0}]\n")
    (tmp_path / "c.yaml").write_text("base_config: base.yaml\nconnectors: {shm: {extra: {a: 1}}}\n")
    with pytest.raises(ValueError, match=r"c.yaml sets \['connectors'\] at top level over its base_config"):
        read_profile(tmp_path / "c.yaml")
    (tmp_path / "s.yaml").write_text("base_config: base.yaml\nstages: [{stage_id: 0, default_pooling_params: {}}]\n")
    with pytest.raises(ValueError, match=r"s.yaml sets \['default_pooling_params'\] at stage over its base_config"):
        read_profile(tmp_path / "s.yaml")
    assert read_profile(tmp_path / "base.yaml")["connectors"] == {"shm": {"name": "S"}}  # a file written whole
    (tmp_path / "l.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="l.yaml is not a deploy YAML"):
        read_profile(tmp_path / "l.yaml")


def test_deploy_config_path_names_and_errors():
    for name in PROFILES:
        assert deploy_config_path(name).is_file()
    assert deploy_config_path("high_throughput") == deploy_config_path("high-throughput")
    with pytest.raises(ValueError, match="unknown deploy profile"):
        deploy_config_path("fastest")


@pytest.mark.parametrize("name", ["high-throughput", "low-latency", "full-decode"])
def test_cli_prints_an_existing_path(name, capsys):
    from higgs_talker.cli import main

    assert main(["deploy-config", name]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.is_file() and path == deploy_config_path(name)


def _hand_over_calls(processor, rows, extra: dict, final_call: bool) -> list:
    """``processor`` (a Stage 0 -> Stage 1 hand-over) called as vllm-omni calls it, once a step with that step's row
    of ``rows`` [N, 8]; the request finishes with its last row, or (``final_call``) in one more call with no output."""
    from types import SimpleNamespace

    manager = SimpleNamespace(code_prompt_token_ids={"r": []}, connector=SimpleNamespace(config={"extra": extra}))
    steps = [rows[i : i + 1] for i in range(len(rows))] + ([None] if final_call or not len(rows) else [])
    payloads = []
    for i, row in enumerate(steps):
        done = i == len(steps) - 1
        status = SimpleNamespace(name="FINISHED_STOPPED" if done else "RUNNING")
        request = SimpleNamespace(external_req_id="r", is_finished=lambda done=done: done, status=status)
        output = None if row is None else {"codes": {"audio": row}}
        payloads.append(processor(manager, output, request, is_finished=done))
    return payloads


_KEYS = ("codec_chunk_frames", "codec_left_context_frames", "codec_right_holdback_frames", "initial_codec_chunk_frames")
# vllm-omni's defaults; our profiles; no context; a first chunk longer than the rest (the rest's); one-frame chunks
_EXTRAS = [{}, *(dict(zip(_KEYS, v, strict=False)) for v in ((25, 10, 4, 1), (3, 0, 0), (7, 2, 5, 9), (1, 3, 1, 0)))]


@pytest.mark.parametrize("extra", _EXTRAS)
def test_our_hand_over_sends_vllm_omnis_payloads(extra):
    """Ours (``deploy.talker2code2wav_async_chunk``: ``codec.streaming``'s windows over the rows it keeps) against
    vllm-omni's own, call for call, where the two are meant to agree (no ramp, the finished flag on time): random
    rows with codes in and out of the codebook (BOC, EOC, negatives), every stream length from none to several
    chunks, the finish with the last row or in a call of its own: the same payloads, codes and meta."""
    from vllm_omni.model_executor.stage_input_processors.higgs_audio_v3 import talker2code2wav_async_chunk as theirs

    from higgs_talker.vllm_plugin.deploy import talker2code2wav_async_chunk as ours

    gen = torch.Generator().manual_seed(len(extra))
    sent = 0
    for n in range(0, 72):
        rows = torch.randint(-2, 1027, (n, 8), generator=gen, dtype=torch.int32)
        for final_call in (False, True):
            want = _hand_over_calls(theirs, rows, extra, final_call)
            got = _hand_over_calls(ours, rows, extra, final_call)
            for i, (a, b) in enumerate(zip(want, got, strict=True)):
                where = f"{n} rows, call {i}, final_call={final_call}"
                assert (a is None) == (b is None), where
                if a is None:
                    continue
                assert torch.equal(a.codes.audio, b.codes.audio) and a.codes.audio.dtype == b.codes.audio.dtype, where
                assert (a.meta.left_context_size, a.meta.right_holdback_size) == (
                    b.meta.left_context_size, b.meta.right_holdback_size), where  # fmt: skip
                assert torch.equal(a.meta.finished, b.meta.finished), where
                sent += a.codes.audio.numel() > 0
    assert sent > 100  # chunks with codes were compared, not only empty finishes
