"""The benchmark scripts' CPU smoke modes (``--device cpu --tiny``), run in-process so the scripts cannot rot.

Each writes its JSON into a temporary directory; the tests check the fields other tools read, not timings.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch
from _tolerance import chain_rel_tol, qwen3_chain

from higgs_talker.tiny import tiny_config

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory):
    """Import a benchmark script by name, with the tiny tokenizer cached in a temp dir (never ~/.cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        mp.syspath_prepend(str(BENCH_DIR))
        yield importlib.import_module


def load(result) -> dict:
    data = json.loads(Path(result.path).read_text())
    assert data["rows"], "no rows written"
    for key in ("date", "command", "torch", "flashinfer", "gpu", "gpu_limits", "cpu"):
        assert key in data["meta"], key
    assert data["meta"]["cpu"].endswith(" cores)"), data["meta"]["cpu"]
    return data


def test_meta_names_the_host_cpu_from_cpuinfo(bench):
    common = bench("common")
    info = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n\nprocessor\t: 1"
    assert common.cpu_model(info).startswith("AMD EPYC 9654 96-Core Processor (")
    arch = common.platform.processor() or common.platform.machine()
    assert common.cpu_model("processor\t: 0\n").startswith(f"{arch} (")  # no model name: the architecture instead
    assert common.gpu_limits(torch.device("cpu")) is None  # nothing to ask nvidia-smi about


def test_attention_smoke(bench, tmp_path: Path) -> None:
    mod = bench("bench_attention")
    data = load(mod.main(["--device", "cpu", "--tiny", "--contexts", "32", "--out", str(tmp_path)]))
    rows = data["rows"]
    sdpa = [r for r in rows if r["variant"].startswith("sdpa")]
    assert {r["variant"] for r in sdpa} == {"sdpa_engine", "sdpa_dense"}
    for r in sdpa:
        assert r["status"] == "ok", r
        assert r["us_per_call"] > 0 and r["rel_err"] <= mod.WRONG_REL_ERR  # the benchmark's own wrong-output line
    flashinfer = [r for r in rows if not r["variant"].startswith("sdpa")]
    assert flashinfer and all(r["status"] == "skipped" for r in flashinfer)
    assert "copy_tb_per_s" in data["meta"] and "summary" in data


def test_decode_smoke(bench, tmp_path: Path) -> None:
    mod = bench("bench_decode")
    argv = ["--device", "cpu", "--tiny", "--modes", "eager,auto", "--batches", "2", "--contexts", "24", "--steps",
            "3", "--warmup", "1", "--fuse", "both", "--sampling", "greedy", "--out", str(tmp_path)]  # fmt: skip
    data = load(mod.main(argv))
    assert data["meta"]["copy_tb_per_s"] > 0
    assert Path(data["meta"]["command"].split()[1]).name == "bench_decode.py"
    assert data["meta"]["samplings"] == {"greedy": {"temperature": 0.0}} and "argmax" in data["meta"]["peers"]
    assert {r["sampling"] for r in data["rows"]} == {"greedy"}  # ours and the peers' rows
    by_mode = {r["mode"]: r for r in data["rows"]}
    eager = by_mode["eager"]
    assert eager["status"] == "ok", eager
    for key in ("batch", "context", "ms_per_step", "floor_ms", "ratio_to_floor", "frames_per_s", "audio_s_per_s"):
        assert isinstance(eager[key], int | float), key
    assert eager["batch"] == 2 and eager["context"] == 24 and eager["prompt_tokens"] == 24
    assert eager["ratio_to_floor"] == pytest.approx(eager["ms_per_step"] / eager["floor_ms"])
    assert by_mode["auto"]["status"] == "error"  # graph modes need CUDA: recorded, not raised
    fused = by_mode["eager-fused"]  # the fusion's A/B row; on CPU both halves run the torch kernels
    assert fused["status"] == "ok" and not fused["fuse_qk_rope"] and not eager["fuse_qk_rope"], fused
    assert "auto-fused" in by_mode
    assert by_mode["hf_eager"]["status"] == "ok", by_mode["hf_eager"]
    assert by_mode["hf_static_compile"]["status"] == "skipped"
    # Same weights, both in fp32: each side is within the chain bound of the exact logits (the tiny shape over
    # peer_check's prompt, plus the codebook head's K = hidden product and its rounding), so twice that.
    t = tiny_config().text
    context = inspect.signature(mod.peer_check).parameters["tokens"].default
    reductions, roundings = qwen3_chain(
        t.hidden_size, t.num_attention_heads, t.head_dim, t.intermediate_size, t.num_hidden_layers, context
    )
    tol = 2 * chain_rel_tol([*reductions, t.hidden_size], roundings + 1, torch.float32)
    assert data["meta"]["peer_rel_err"] <= tol, (data["meta"]["peer_rel_err"], tol)


def test_decode_sampling_deploy_and_greedy_in_one_run(bench, tmp_path: Path, capsys) -> None:
    """The default ``--sampling deploy,greedy``: every point timed at both, deploy first (the headline), the rows
    labelled, deploy's requests on the whole sampler (noise, top-k / top-p filter), greedy's on the argmax path."""
    mod = bench("bench_decode")
    argv = ["--device", "cpu", "--tiny", "--modes", "eager", "--batches", "1,2", "--contexts", "16", "--steps", "2",
            "--warmup", "1", "--no-peers", "--out", str(tmp_path)]  # fmt: skip
    data = load(mod.main(argv))
    rows = data["rows"]
    assert [(r["batch"], r["sampling"], r["status"]) for r in rows] == [
        (1, "deploy", "ok"), (1, "greedy", "ok"), (2, "deploy", "ok"), (2, "greedy", "ok")]  # fmt: skip
    for r in rows:
        deploy = r["sampling"] == "deploy"
        assert r["sampling_params"] == mod.SAMPLINGS[r["sampling"]]
        assert (r["sampler_draw"], r["sampler_filter"]) == (deploy, deploy), r
        assert r["ratio_to_floor"] == pytest.approx(r["ms_per_step"] / r["floor_ms"])
        assert r["finish_reasons"] == [], r  # the zeroed EOC row: no request ends early, sampled or not
    assert data["meta"]["headline_sampling"] == "deploy"
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("| context"))
    assert header.index("eager-fused deploy") < header.index("eager-fused greedy")
    assert "best/floor deploy" in header and "best/floor greedy" in header


def test_deploy_sampling_is_the_deploy_profiles(bench) -> None:
    """``deploy`` is what the packaged deploy profiles send by default (their stage 0's default_sampling_params)."""
    pytest.importorskip("yaml")
    from higgs_talker.vllm_plugin.deploy import PROFILES, deploy_config_path

    common, stage_of = bench("common"), bench("bench_omni").stage_of
    for profile in PROFILES:
        stage = stage_of(deploy_config_path(profile), 0)
        defaults = stage["default_sampling_params"]
        assert {k: defaults[k] for k in common.SAMPLINGS["deploy"]} == common.SAMPLINGS["deploy"], profile


def test_sampling_option_refuses_unknown_names(bench, capsys) -> None:
    mod = bench("bench_decode")
    with pytest.raises(SystemExit) as exc:
        mod.parse_args(["--sampling", "deploy,nucleus", "--no-peers"])
    assert exc.value.code == 2 and "unknown sampling(s) ['nucleus']" in capsys.readouterr().err
    assert mod.parse_args(["--no-peers"]).sampling == ["deploy", "greedy"]
    assert mod.parse_args(["--sampling", "greedy,deploy,greedy", "--no-peers"]).sampling == ["greedy", "deploy"]


def test_decode_head_kernels_both_times_each_variant_with_its_own_path(bench, tmp_path: Path, monkeypatch) -> None:
    """``--head-kernels both``: a ``-torchhead`` row beside each mode's, built and timed with the torch frame
    operations (the switch is read while the variant runs, then put back)."""
    from higgs_talker.heads import fused

    mod = bench("bench_decode")
    seen = []
    real = mod._run_variant
    monkeypatch.setattr(mod, "_run_variant", lambda v, *a: (seen.append((v.label, fused.ENABLED)), real(v, *a)))
    argv = ["--device", "cpu", "--tiny", "--modes", "eager", "--batches", "1", "--contexts", "16", "--steps", "2",
            "--warmup", "1", "--head-kernels", "both", "--sampling", "greedy", "--no-peers",
            "--out", str(tmp_path)]  # fmt: skip
    data = load(mod.main(argv))
    assert seen == [("eager-fused", True), ("eager-fused-torchhead", False)]
    assert [(r["mode"], r["status"]) for r in data["rows"]] == [("eager-fused", "ok"), ("eager-fused-torchhead", "ok")]
    assert fused.ENABLED
    # each row says what its frame kernels did: none runs on CPU (untried), the torch-head row turned them off
    names = ("sampler noise", "sampler race", "delay mask", "delay state update")
    kernels = [r["frame_kernels"] for r in data["rows"]]
    assert kernels == [dict.fromkeys(names, "untried"), dict.fromkeys(names, "disabled")]


def test_decode_rows_say_which_frame_kernels_ran(bench, monkeypatch) -> None:
    """``frame_kernels``: a kernel that failed its first-use check reads ``off`` (the reference ran: its A/B timed
    nothing), one the variant turned off ``disabled``, a checked one ``ok``."""
    from higgs_talker.heads import fused

    mod = bench("bench_decode")
    monkeypatch.setattr(fused, "_state", {"sampler race": "off"})
    monkeypatch.setattr(fused, "_checked", {"delay mask": {("sig",)}, "sampler race": {("sig",)}})
    monkeypatch.setattr(fused, "DISABLED", {"delay state update"})
    assert mod.frame_kernel_states() == {"sampler noise": "untried", "sampler race": "off", "delay mask": "ok",
                                         "delay state update": "disabled"}  # fmt: skip


def test_decode_variant_grid_and_labels(bench) -> None:
    mod = bench("bench_decode")
    args = mod.parse_args(["--modes", "auto", "--sampler-variants", "both", "--head-kernels", "both", "--no-peers"])
    labels = [v.label for v in mod.variants(args)]
    assert labels == ["auto-fused", "auto-fused-wholesampler", "auto-fused-torchhead",
                      "auto-fused-torchhead-wholesampler"]  # fmt: skip
    args = mod.parse_args(["--modes", "auto", "--race-kernel", "both", "--head-kernels", "both", "--no-peers"])
    # the race is one of the head kernels: without them there is no race kernel to turn on
    assert [v.label for v in mod.variants(args)] == ["auto-fused", "auto-fused-torchrace", "auto-fused-torchhead"]


def test_decode_refuses_a_budget_the_peers_would_eat(bench, capsys) -> None:
    mod = bench("bench_decode")
    with pytest.raises(SystemExit) as exc:
        mod.parse_args(["--budget-s", "60"])
    assert exc.value.code == 2 and "--budget-s 60 leaves no time for our modes" in capsys.readouterr().err
    assert mod.parse_args(["--budget-s", "60", "--no-peers"]).budget_s == 60


def test_decode_refuses_an_unknown_decode_kernel(bench, capsys) -> None:
    mod = bench("bench_decode")
    with pytest.raises(SystemExit) as exc:
        mod.parse_args(["--decode-kernels", "xqa,fast", "--no-peers"])
    assert exc.value.code == 2 and "unknown decode kernel(s) ['fast']" in capsys.readouterr().err
    assert mod.parse_args(["--decode-kernels", "native_tc,auto", "--no-peers"]).decode_kernels == ["native_tc", "auto"]


def test_e2e_smoke(bench, tmp_path: Path) -> None:
    mod = bench("bench_e2e")
    argv = ["--device", "cpu", "--tiny", "--modes", "eager", "--levels", "1,2", "--requests", "2",
            "--audio-s", "0.3,0.4", "--out", str(tmp_path)]  # fmt: skip
    data = load(mod.main(argv))  # the default --sampling deploy,greedy: both at every level, deploy first
    assert [(r["concurrency"], r["sampling"]) for r in data["rows"]] == [
        (1, "deploy"), (1, "greedy"), (2, "deploy"), (2, "greedy")]  # fmt: skip
    assert data["meta"]["samplings"] == {s: mod.SAMPLINGS[s] for s in ("deploy", "greedy")}
    for r in data["rows"]:
        assert r["status"] == "ok", r
        assert r["ttfp_ms_p50"] > 0 and r["rtf_p50"] > 0 and r["ttfp_ms_p50"] <= r["ttfp_ms_p99"]
    assert sorted(req["sampling"] for req in data["requests"]) == ["deploy"] * 4 + ["greedy"] * 4
    for req in data["requests"]:  # sampled or greedy, the zeroed EOC row keeps every request to its length
        assert req["finish_reason"] == "max_frames" and req["frames"] == req["target_frames"]


def test_e2e_on_cpu_defaults_to_eager_and_fails_where_every_row_did(bench, tmp_path: Path) -> None:
    """Without ``--modes`` a CPU run times ``eager`` (``auto`` needs CUDA); a run whose rows all failed exits
    non-zero with the first error in one line, not 0 beside a table of errors."""
    mod = bench("bench_e2e")
    argv = ["--device", "cpu", "--tiny", "--levels", "1", "--requests", "1", "--audio-s", "0.3,0.3",
            "--sampling", "greedy", "--out", str(tmp_path)]  # fmt: skip
    data = load(mod.main(argv))
    assert [(r["mode"], r["status"]) for r in data["rows"]] == [("eager", "ok")]
    with pytest.raises(SystemExit) as exc:
        mod.main([*argv, "--modes", "auto"])
    message = str(exc.value.code)
    assert message.startswith("bench_e2e.py: every row failed") and "needs a CUDA device" in message, message
    assert "\n" not in message


def test_e2e_prefill_graphs_both_gives_a_row_set_each(bench, tmp_path: Path) -> None:
    """``--prefill-graphs both``: each mode without and with prefill graphs, labelled apart (CPU builds no graphs,
    so this checks the labels and the plumbing into the API)."""
    mod = bench("bench_e2e")
    argv = ["--device", "cpu", "--tiny", "--modes", "eager", "--levels", "1", "--requests", "1",
            "--audio-s", "0.3,0.3", "--prefill-graphs", "both", "--sampling", "greedy",
            "--out", str(tmp_path)]  # fmt: skip
    data = load(mod.main(argv))
    assert [(r["mode"], r["status"]) for r in data["rows"]] == [("eager-eagerprefill", "ok"), ("eager", "ok")]


def test_e2e_one_voice_with_and_without_prefix_caching(bench, tmp_path: Path) -> None:
    """``--voice-s`` puts one reference voice in every prompt; ``--prefix-caching both`` runs each mode without and
    with the cache: with it, every request after the first finds the voice's blocks, and the rows agree."""
    mod = bench("bench_e2e")
    argv = ["--device", "cpu", "--tiny", "--modes", "eager", "--levels", "1", "--requests", "3", "--voice-s", "1",
            "--audio-s", "0.3,0.3", "--prefix-caching", "both", "--sampling", "deploy",
            "--out", str(tmp_path)]  # fmt: skip
    data = load(mod.main(argv))
    assert [(r["mode"], r["status"]) for r in data["rows"]] == [("eager", "ok"), ("eager+pcache", "ok")]
    reqs = {m: [r for r in data["requests"] if r["mode"] == m] for m in ("eager", "eager+pcache")}
    assert all(r["prompt_tokens"] > 25 for r in data["requests"])  # 1 s of voice: 32 placeholder rows and more
    assert [r["cached_tokens"] for r in reqs["eager"]] == [0, 0, 0]
    cached = [r["cached_tokens"] for r in reqs["eager+pcache"]]
    assert cached[0] == 0 and min(cached[1:]) >= 32, cached  # the first request fills the cache (warm-up: no voice)


def test_plot_smoke(bench, tmp_path: Path) -> None:
    """plot.py turns the JSONs into PNGs, or says matplotlib is missing, writes nothing and exits non-zero."""
    plot = bench("plot")
    decode = {"meta": {"date": "2026-01-01"}, "rows": [
        {"mode": m, "batch": b, "context": 512, "ms_per_step": 2.0 * b, "floor_ms": 1.0, "status": "ok"}
        for m in ("eager", "hf_eager") for b in (1, 4)]}  # fmt: skip
    e2e = {"meta": {}, "rows": [
        {"mode": "auto", "concurrency": c, "status": "ok", **{f"{m}_p{q}": 1.0 * c for m in ("ttfp_ms", "rtf")
                                                              for q in (50, 90, 99)}} for c in (1, 4)]}  # fmt: skip
    attention = {"meta": {}, "rows": [
        {"variant": v, "batch": 1, "context": c, "page_size": 16, "layout": "NHD", "us_per_call": 10.0, "status": "ok"}
        for v in ("fi_native", "xqa_own", "xqa_1block") for c in (256, 1024)]}  # fmt: skip
    speech = {f"{m}_p{q}": 10.0 for m in ("ttfa_ms", "rtf") for q in (50, 90)} | {"audio_s_per_s": 5.0}
    skipped = {"path": "http", "concurrency": 16, "status": "skipped"}
    serve = {"meta": {}, "rows": [
        {"path": p, "chunking": "exact", "sampling": "deploy", "concurrency": c, "status": "ok", **speech}
        for p in ("direct", "http") for c in (1, 4)] + [skipped]}  # fmt: skip
    omni = {"meta": {}, "rows": [
        {"talker": t, "profile": "low_latency", "path": "offline", "concurrency": c, "status": "ok", **speech,
         "ttfa_ms_p90": None} for t in ("ours", "upstream") for c in (1, 4)]}  # fmt: skip
    files = []
    for name, data in (("decode_x.json", decode), ("e2e_x.json", e2e), ("attention_x.json", attention),
                       ("serve_x.json", serve), ("omni_x.json", omni)):  # fmt: skip
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(data))
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # not installed here: the script must say so and fail (the next test forces this case)
        with pytest.raises(SystemExit) as exc:
            plot.main([str(f) for f in files])
        assert exc.value.code and "matplotlib is not installed" in str(exc.value.code)
        return
    written = plot.main([str(f) for f in files])
    assert sorted(p.name for p in written) == ["attention_x.png", "decode_x.png", "e2e_x.png", "omni_x.png",
                                               "serve_x.png"]  # fmt: skip


def test_plot_without_matplotlib_exits_nonzero(bench, tmp_path: Path, monkeypatch) -> None:
    plot = bench("plot")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    f = tmp_path / "decode_x.json"
    f.write_text(json.dumps({"meta": {}, "rows": []}))
    with pytest.raises(SystemExit) as exc:
        plot.main([str(f)])
    assert exc.value.code and "pip install -e '.[bench]'" in str(exc.value.code)
    assert not list(tmp_path.glob("*.png"))


def test_plot_picks_the_newest_result_by_when_it_was_measured(bench, tmp_path: Path) -> None:
    """By the stamp in the file name (else ``meta.date``), in ``results/`` and its dated subfolders, never by the
    modification time (a fresh clone gives every file the same one; here the oldest file is touched last)."""
    import os

    plot = bench("plot")
    files = {
        "decode_20261130-215728.json": "2026-11-30T21:57:28",
        "h200_20261202c/decode_20261202-062505.json": "2026-12-02T06:25:05",
        "h200_20261201/decode_20261201-170621.json": "2026-12-01T17:06:21",
        "h200_20261202c/e2e_20261202-062421.json": "2026-12-02T06:24:21",
        "e2e_20261130-221228.json": "2026-11-30T22:12:28",
        "attention_old.json": "2026-11-29T23:30:12+00:00",  # no stamp in the name: meta.date decides
        "sub/attention_new.json": "2026-11-30T22:01:34+00:00",
    }
    for i, (name, date) in enumerate(files.items()):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": {"date": date}, "rows": []}))
        os.utime(path, (1e9 - i, 1e9 - i))  # listed first = touched last
    chosen = [p.relative_to(tmp_path).as_posix() for p in plot.newest(tmp_path)]
    assert chosen == ["h200_20261202c/decode_20261202-062505.json", "h200_20261202c/e2e_20261202-062421.json",
                      "sub/attention_new.json"]  # fmt: skip
    assert plot.measured_at(tmp_path / "attention_old.json") == "20261129-233012"


def test_a_player_waits_only_where_audio_comes_after_what_it_has_ends(bench) -> None:
    """``http_load.Playback``: a first chunk of 40 ms at t = 0 and the next at 100 ms leave a 60 ms gap; audio that
    comes while the player still has some adds none; a second gap adds to the first."""
    player = bench("http_load").Playback()
    player.arrive(0.0, 0.04)
    player.arrive(0.1, 1.0)  # plays until 1.1
    player.arrive(0.5, 0.2)  # until 1.3
    assert (player.stall_s, player.stalls) == (pytest.approx(0.06), 1)
    player.arrive(1.5, 0.04)
    assert (player.stall_s, player.stalls, player.until) == (pytest.approx(0.26), 2, pytest.approx(1.54))


def test_codec_smoke(bench, tmp_path: Path) -> None:
    mod = bench("bench_codec")
    argv = ["--device", "cpu", "--tiny", "--quick", "--seconds", "1.2", "--ref-seconds", "1", "--repeats", "1",
            "--dtypes", "fp32", "--out", str(tmp_path)]  # fmt: skip
    data = load(mod.main(argv))
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == set(mod.CPU_MODES)  # the _graphs modes are CUDA's
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["ms_per_audio_s"] > 0 and r["x_realtime"] == pytest.approx(1e3 / r["ms_per_audio_s"])
    exact, upstream = rows["stream_exact"], rows["stream_upstream"]
    assert exact["exact"] and exact["same_length"] and exact["rel_err"] < 1e-4
    assert (exact["first_chunk_after_frames"], upstream["first_chunk_after_frames"]) == (11, 5)
    assert not upstream["exact"] and upstream["same_length"]
    assert rows["encode"]["frames"] == 25


def test_coldstart_smoke(bench, tmp_path: Path) -> None:
    """Two fresh processes (about 15 s on 2 CPU cores): ``higgs-talker warmup`` into a new cache dir, then a run
    timed from spawn to its first decode step. The cold and warm cases run the same child."""
    mod = bench("bench_coldstart")
    argv = ["--device", "cpu", "--tiny", "--no-cold", "--repeats", "0", "--with-warmup", "--work-dir",
            str(tmp_path / "work"), "--out", str(tmp_path)]  # fmt: skip
    data = load(mod.main(argv))
    warmup, run = data["rows"]
    assert (warmup["case"], run["case"]) == ("warmup_cmd", "after_warmup")
    assert warmup["status"] == "ok" and "nothing to compile" in warmup["output"], warmup
    assert run["status"] == "ok", run
    assert run["rows"] == 2  # the prefill's row and the first decode step's
    assert run["choices"] == "none" and run["choice_file"] is None  # CPU measures nothing
    for key in ("import_s", "load_s", "first_step_s"):
        assert run[key] > 0, key
    assert run["total_s"] == pytest.approx(run["import_s"] + run["load_s"] + run["first_step_s"])
    assert run["flashinfer_cache"] == str(tmp_path / "work" / "warmup" / ".cache" / "flashinfer")
    assert set(run["caches_before"]) == set(run["caches_after"]) == {"flashinfer", "tvm_ffi", "triton", "choices"}
    # the load's INFO records, stamped from spawn: the weights are loaded within load_s, after the import
    loaded = [t for t, name, msg in run["phases"] if name == "higgs_talker.api" and msg.startswith("loaded ")]
    assert len(loaded) == 1 and run["import_s"] < loaded[0] <= run["import_s"] + run["load_s"], run["phases"]


@pytest.mark.parametrize(("release", "live"), [("0.26.0", False), ("0.29.1", False), ("0.30.0", True)])
def test_omni_offline_outputs_stream_only_where_the_generator_leaves_the_engine_open(
    bench, monkeypatch, release: str, live: bool
) -> None:
    """vllm-omni 0.26's ``generate(py_generator=True)`` closes the whole ``Omni`` when its generator ends; below
    0.30 bench_omni asks for the list instead (no first-chunk times)."""
    import importlib.metadata

    import bench_omni

    calls = []

    class FakeOmni:
        def generate(self, prompts, params, **kw):
            calls.append(kw)
            return iter(["out"]) if kw.get("py_generator") else ["out"]

    monkeypatch.setattr(importlib.metadata, "version", lambda name: release if name == "vllm-omni" else "0")
    streams = bench_omni.offline_streams()
    assert streams is live
    assert list(bench_omni.offline_outputs(FakeOmni(), ["p"], ["s"], streams)) == ["out"]
    assert calls == [{"py_generator": True, "use_tqdm": False} if live else {"use_tqdm": False}]


def test_omni_budget_records_what_it_did_not_start(bench, tmp_path: Path, tiny_dir) -> None:
    """With its budget spent, bench_omni starts no worker (no vllm-omni needed) and writes one skipped row per
    configuration, so a run cut short by --budget-s still says what it left out."""
    mod = bench("bench_omni")
    data = load(mod.main(["--model", str(tiny_dir), "--budget-s", "0", "--levels", "1", "--out", str(tmp_path)]))
    configs = {(r["talker"], r["profile"], r["path"]) for r in data["rows"]}
    ours = {("ours", pr, pa) for pr in mod.PROFILES for pa in ("offline", "http")}
    theirs = {("upstream", pr, pa) for pr in mod.PROFILES if pr not in mod.UPSTREAM_SAME for pa in ("offline", "http")}
    assert configs == ours | theirs | {("ours", "direct", "direct")}
    assert len(data["rows"]) == len(configs) and {r["status"] for r in data["rows"]} == {"skipped"}
    assert set(mod.UPSTREAM_SAME.values()) <= set(mod.PROFILES) - set(mod.UPSTREAM_SAME)  # each is run under its name


def test_omni_without_vllm_exits_2_before_any_work(tmp_path: Path) -> None:
    """Without vllm / vllm_omni (hidden here), ``bench_omni.py --smoke`` stops at once with status 2 and one line
    naming them and the install, before writing a checkpoint or starting a worker (it used to spend 2 minutes on
    failing workers, then end in a traceback)."""
    import subprocess
    import time

    script = BENCH_DIR / "bench_omni.py"
    code = (f"import runpy, sys; sys.modules.update(vllm=None, vllm_omni=None); "
            f"sys.argv = [{str(script)!r}, '--smoke', '--ckpt-dir', {str(tmp_path / 'ckpt')!r}]; "
            f"runpy.run_path({str(script)!r}, run_name='__main__')")  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert time.perf_counter() - t0 < 60
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "needs vllm and vllm_omni" in out.stderr and "pip install -e '.[vllm]'" in out.stderr, out.stderr
    assert not list(tmp_path.iterdir())  # no checkpoint written


def test_omni_runs_vllm_omnis_talker_once_under_the_nearest_profile(bench, tmp_path: Path, tiny_dir) -> None:
    """Asked for a profile with our frame graphs, vllm-omni's talker runs the one without (``UPSTREAM_SAME``),
    listed under that name, and only once where that one is asked for too."""
    mod = bench("bench_omni")
    profiles = "low_latency_async_frame_graphs,low_latency_async,full_decode_64_async_frame_graphs"
    argv = ["--model", str(tiny_dir), "--budget-s", "0", "--levels", "1", "--out", str(tmp_path), "--paths", "offline",
            "--profiles", profiles]  # fmt: skip
    rows = load(mod.main(argv))["rows"]
    assert [(r["talker"], r["profile"]) for r in rows] == [
        ("ours", "low_latency_async_frame_graphs"), ("ours", "low_latency_async"),
        ("ours", "full_decode_64_async_frame_graphs"), ("upstream", "low_latency_async"),
        ("upstream", "full_decode_64_async"),
    ]  # fmt: skip


def test_omni_budget_is_shared_among_the_configurations_left(bench, monkeypatch) -> None:
    """Each worker gets an equal share of the budget left when it starts (vllm-omni's first talker used 274 s of a
    400 s budget on the H200 and the second was stopped before its first figure), within its own limit."""
    import bench_omni

    monkeypatch.setattr(bench_omni.time, "perf_counter", lambda: 100.0)
    assert bench_omni.worker_limit(900.0, None, 3) == 900.0  # no budget: the worker's own limit
    assert bench_omni.worker_limit(900.0, 400.0, 2) == 150.0  # 300 s left, two configurations
    assert bench_omni.worker_limit(900.0, 400.0, 1) == 300.0  # the last takes all that is left
    assert bench_omni.worker_limit(120.0, 400.0, 1) == 120.0
    assert bench_omni.worker_limit(900.0, 90.0, 2) == 1.0  # spent: at least a second, then skipped rows
    # --min-worker-s: a share too short to start a pipeline grows to it while the budget lasts
    assert bench_omni.worker_limit(900.0, 570.0, 4, least=240.0) == 240.0  # 470 s for four: 117.5 each otherwise
    assert bench_omni.worker_limit(900.0, 250.0, 3, least=240.0) == 150.0  # only 150 s left: all of it
    assert bench_omni.worker_limit(900.0, 900.0, 2, least=240.0) == 400.0  # a longer share stands


def _worker(tmp_path: Path, lines: str):
    """A stand-in bench_omni worker in its own session: prints ``lines`` after starting a child that would outlive it (a
    stage process), then hangs (a shutdown that does not end). Returns (proc, log path, child pid file)."""
    import subprocess

    log, child = tmp_path / "worker.log", tmp_path / "child.pid"
    code = (f"import subprocess, sys, time; "
            f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(child)!r}, 'w').write(str(c.pid)); print({lines!r}, flush=True); time.sleep(600)")  # fmt: skip
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    return proc, log, child


def _gone(pid: int) -> bool:
    import time

    for _ in range(50):  # a killed process may stay a zombie of its (killed) parent for a moment
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_omni_worker_done_with_its_levels_is_stopped_in_its_shutdown(bench, monkeypatch, tmp_path: Path) -> None:
    """A worker that printed every level and hangs in vllm-omni's shutdown (two of four on the H200, 2026-12-04,
    each then charged with its whole budget share and recorded as stopped) counts as done after SHUTDOWN_S, and
    its stage processes go with it; without the marker the limit still stops it."""
    import subprocess
    import time

    import bench_omni

    monkeypatch.setattr(bench_omni, "SHUTDOWN_S", 1.0)
    proc, log, child = _worker(tmp_path, "RESULT:[]\n" + bench_omni.LEVELS_DONE)
    t0 = time.perf_counter()
    assert bench_omni.wait_worker(proc, log, limit=60.0) == 0
    assert time.perf_counter() - t0 < 30
    assert proc.poll() is not None and _gone(int(child.read_text()))

    proc, log, child = _worker(tmp_path, "RESULT:[]")  # levels not done: the limit applies
    with pytest.raises(subprocess.TimeoutExpired):
        bench_omni.wait_worker(proc, log, limit=3.0)
    bench_omni.stop_group(proc, log)
    assert proc.poll() is not None and _gone(int(child.read_text()))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_stopped_omni_worker_takes_the_server_it_started_with_it(bench, tmp_path: Path) -> None:
    """An HTTP worker stopped at its limit also ends the server it started in a session of its own (named by its
    SERVER_GROUP line): on the H100 (2026-12-06) a stopped worker's server kept 55 GiB and the next configuration's
    server failed to start. The server's own child (a stage process) goes too, and stop_group returns only then."""
    import subprocess
    import time

    import bench_omni

    server = tmp_path / "server.pid"
    stage = tmp_path / "stage.pid"
    server_code = (f"import subprocess, sys, time; "
                   f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                   f"open({str(stage)!r}, 'w').write(str(c.pid)); time.sleep(600)")  # fmt: skip
    code = (f"import subprocess, sys, time; "
            f"s = subprocess.Popen([sys.executable, '-c', {server_code!r}], start_new_session=True); "
            f"open({str(server)!r}, 'w').write(str(s.pid)); "
            f"print({bench_omni.SERVER_GROUP!r} + str(s.pid), flush=True); time.sleep(600)")  # fmt: skip
    log = tmp_path / "worker.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    for _ in range(100):
        if stage.exists() and bench_omni.SERVER_GROUP in log.read_text():
            break
        time.sleep(0.1)
    with pytest.raises(subprocess.TimeoutExpired):
        bench_omni.wait_worker(proc, log, limit=1.0)
    bench_omni.stop_group(proc, log)
    assert proc.poll() is not None
    assert not bench_omni._group_alive(int(server.read_text()))
    assert _gone(int(server.read_text())) and _gone(int(stage.read_text()))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("guarded", [True, False], ids=["sigterm_as_interrupt", "unguarded"])
def test_a_sigtermed_run_still_stops_the_server_it_started(tmp_path: Path, guarded: bool) -> None:
    """A process that starts a server in a session of its own and stops it in a ``finally`` (bench_omni's main and
    workers, test_omni_gpu's server fixture), stopped by SIGTERM as ``timeout`` stops it: under
    ``sigterm_as_interrupt`` the ``finally`` runs and the server goes; without it the server outlives it (as
    ``vllm-omni serve`` outlived a pytest on the H100, 2026-12-07)."""
    import contextlib
    import os
    import signal
    import subprocess
    import time

    server = tmp_path / "server.pid"
    guard = "bench_omni.sigterm_as_interrupt()" if guarded else "contextlib.nullcontext()"
    code = (f"import contextlib, os, signal, subprocess, sys, time; sys.path.insert(0, {str(BENCH_DIR)!r}); "
            f"import bench_omni\n"
            f"with {guard}:\n"
            f"    s = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
            f"                         start_new_session=True)\n"
            f"    open({str(server)!r}, 'w').write(str(s.pid))\n"
            f"    try:\n"
            f"        time.sleep(600)\n"
            f"    finally:\n"
            f"        os.killpg(s.pid, signal.SIGKILL)\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code])
    for _ in range(200):
        if server.exists() and server.read_text():
            break
        time.sleep(0.1)
    pid = int(server.read_text())
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    try:
        assert _gone(pid) == guarded, f"server {'outlived' if guarded else 'did not outlive'} its starter"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="the run without vLLM")
def test_vllm_cpu_without_vllm_names_it_and_exits_nonzero(bench, tmp_path: Path, tiny_dir) -> None:
    """``bench_vllm.py --cpu`` without vLLM: each failed worker's cause in its row and one log line, a non-zero exit
    that names vllm, and the direct engine not run (there is nothing to set it beside)."""
    mod = bench("bench_vllm")
    argv = ["--cpu", "--profiles", "high_throughput", "--trtllm", "false", "--levels", "1", "--model", str(tiny_dir),
            "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        mod.main(argv)
    message = str(exc.value.code)
    assert "every vLLM worker failed" in message and "No module named 'vllm'" in message, message
    (path,) = tmp_path.glob("vllm_*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["profile"], r["status"]) for r in rows] == [("high_throughput", "error"), ("direct", "skipped")]
    assert rows[0]["error"].endswith("ModuleNotFoundError: No module named 'vllm'"), rows[0]


def test_a_smoke_run_without_out_writes_to_a_temporary_folder(bench, monkeypatch, tmp_path: Path) -> None:
    """A ``--tiny`` / ``--cpu`` / ``--smoke`` run given no ``--out`` stays out of ``results/`` (where it became the
    newest file of its kind for ``plot.py``); a real run without ``--out`` still writes there."""
    common = bench("common")
    monkeypatch.setattr(common, "SMOKE_DIR", tmp_path / "smoke")
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    assert common.ResultFile(None, "decode", {}, smoke=True).path.parent == tmp_path / "smoke"
    assert common.ResultFile(None, "decode", {}).path.parent == tmp_path / "results"
    assert common.ResultFile(tmp_path / "mine", "decode", {}, smoke=True).path.parent == tmp_path / "mine"


def test_serve_host_probe_smoke(bench, tmp_path: Path) -> None:
    """probes/serve_host.py: the engine, frame streams and audio streams on the stand-in device, which paces the
    steps (a request of 30 frames takes at least 30 steps of 4 ms) and makes every stream's audio."""
    mod = bench("probes.serve_host")
    argv = ["--streams", "1,2", "--frames", "30", "--repeats", "1", "--out", str(tmp_path)]
    data = load(mod.main(argv))
    assert [(r["path"], r["streams"]) for r in data["rows"]] == [
        (p, n) for n in (1, 2) for p in ("engine", "frames", "audio")
    ]
    assert all(r["wall_s"] >= 30 * 4e-3 and 0 < r["of_bound"] <= 1.0 for r in data["rows"]), data["rows"]
    # the stand-in device's busy share: its steps alone reach of_bound (they pace the run), and it cannot exceed the
    # wall time by more than a step launched ahead and dropped at the end; no codec but for audio
    assert all(r["of_bound"] <= r["device_busy"] <= 1 + 8e-3 / r["wall_s"] for r in data["rows"]), data["rows"]
    assert all((r["codec_busy"] > 0) == (r["path"] == "audio") for r in data["rows"]), data["rows"]
    assert Path(data["meta"]["command"].split()[1]).name == "serve_host.py"


def _stage_log(requests: list[tuple[str, int, float, float, float]]) -> str:
    """A ``vllm-omni serve`` log as 0.26 writes it (logger prefix, colours) with, per request (id, Stage-0 rows,
    Stage-0 ms a step, Stage-1 audio s, whole ms), its RequestE2EStats and StageRequestStats tables."""
    pre = "\x1b[0;36m(APIServer pid=1540)\x1b[0;0m INFO 12-06 04:15:10 [stats.py:874] "
    out = [pre + "Uvicorn running on http://0.0.0.0:8000"]
    for rid, rows, step, audio, whole in requests:
        out += [pre, pre + f"[RequestE2EStats [request_id={rid}]]", pre + "+------------------+---------+",
                pre + "| Field            |   Value |", pre + "+------------------+---------+",
                pre + f"| e2e_total_ms     | {whole:,.3f} |", pre + "| e2e_total_tokens |     116 |",
                pre + "+------------------+---------+", pre + f"[OmniTiming] req={rid} total=0.34s", pre,
                pre + f"[StageRequestStats [request_id={rid}]]", pre + "+------+------+------+",
                pre + "| Field                           |            0 |             1 |",
                pre + "+------+------+------+",
                pre + f"| audio_duration_s                |        0.000 |        {audio:.3f} |",
                pre + f"| inter_output_latency_ms         |        {step:.3f} |       108.705 |",
                pre + f"| num_tokens_out                  |           {rows} |             0 |",
                pre + "| serving_time_to_first_output_ms |       54.200 |       130.541 |",
                pre + f"| stage_gen_time_ms               |      {rows * step:,.3f} |       334.618 |",
                pre + f"| vllm_tpot_ms                    |        {step:.3f} |         0.000 |",
                pre + "| vllm_ttft_ms                    |       54.055 |       116.827 |",
                pre + "+------+------+------+", pre + "[SpeechE2E] request_id=x stream=true status=ok"]  # fmt: skip
    return "\n".join(out) + "\n"


def test_omni_stage_stats_reads_each_levels_timed_requests_from_the_server_log(bench, tmp_path: Path) -> None:
    """``omni_stage_stats.py``: the warm-up requests (fewer Stage-0 rows) are left out, the timed ones are assigned
    to the run's levels in order, and each level gets its medians and the count of requests whose audio came twice."""
    mod = bench("omni_stage_stats")
    log = _stage_log([("warm-0", 58, 9.0, 1.96, 300.0), ("a", 208, 4.0, 7.96, 900.0), ("warm-1", 58, 9.0, 1.96, 300.0),
                      ("b", 208, 5.0, 15.88, 1000.0), ("c", 208, 6.0, 7.96, 1200.0)])  # fmt: skip
    (tmp_path / "server_ours_p.log").write_text(log)
    rows = [{"talker": "ours", "profile": "p", "path": "http", "status": "ok", "concurrency": level, "requests": n,
             "audio_s_per_s": 8.6} for level, n in ((1, 1), (2, 2))]  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    got = mod.summarize(json.loads((tmp_path / "run.json").read_text()), {"server_ours_p.log": log})
    assert [(r["concurrency"], r["requests"], r["stage0_rows"]) for r in got] == [(1, 1, 208), (2, 2, 208)]
    assert [r["s0_step_ms_p50"] for r in got] == [4.0, 5.5] and [r["e2e_ms_p50"] for r in got] == [900.0, 1100.0]
    assert [r["s1_over_length"] for r in got] == [0, 1] and got[1]["s0_gen_s_p50"] == pytest.approx(208 * 5.5e-3)
    with pytest.raises(ValueError, match="2 requests of 208 Stage-0 rows, the run's rows count 3"):
        mod.summarize({"rows": rows}, {"server_ours_p.log": _stage_log([("a", 208, 4.0, 7.96, 900.0)] * 2)})


def test_omni_http_rows_carry_their_servers_stage_figures(bench, tmp_path: Path) -> None:
    """``bench_omni``'s HTTP rows get each level's Stage-0 step and Stage-1 figures from the server's log; a log
    without the tables leaves the rows as they were."""
    bench("omni_stage_stats")
    mod = bench("bench_omni")
    log = tmp_path / "server_ours_p.log"
    log.write_text(_stage_log([("w", 58, 9.0, 1.96, 300.0), ("a", 208, 4.0, 7.96, 900.0), ("b", 208, 5.0, 7.96, 950.0),
                               ("c", 208, 6.0, 15.88, 1000.0), ("d", 208, 7.0, 7.96, 990.0)]))  # fmt: skip
    rows = [{"talker": "ours", "profile": "p", "path": "http", "status": "ok", "concurrency": level, "requests": n,
             "audio_s_per_s": 1.0} for level, n in ((1, 1), (2, 2))]  # fmt: skip
    got = mod.with_stage_stats(rows, log)  # "d": a third level cut before its row was written
    figures = [(r["s0_step_ms_p50"], r["e2e_ms_p50"], r["s1_over_length"]) for r in got]
    assert figures == [(4.0, 900.0, 0), (5.5, 975.0, 1)]
    log.write_text("no tables here\n")
    assert mod.with_stage_stats(rows, log) == rows


def test_omni_direct_path_streams_our_engine(bench, tmp_path: Path) -> None:
    """``bench_omni.py --smoke --paths direct`` (no vLLM needed): its worker writes the small real-layout checkpoint,
    streams it through our engine and codec (``stream_audio``, vllm-omni's chunking) at 1 and 2 streams on CPU, and
    each level's row counts every request's full second of audio, labelled as the direct path."""
    mod = bench("bench_omni")
    argv = ["--smoke", "--paths", "direct", "--talkers", "ours", "--ckpt-dir", str(tmp_path / "ckpt"), "--out",
            str(tmp_path)]  # fmt: skip
    rows = load(mod.main(argv))["rows"]
    assert [(r["talker"], r["profile"], r["path"], r["concurrency"], r["status"]) for r in rows] == [
        ("ours", "direct", "direct", 1, "ok"), ("ours", "direct", "direct", 2, "ok")
    ]  # fmt: skip
    for r in rows:
        assert r["requests"] == mod.level_requests(r["concurrency"]) and r["over_length"] == 0, r
        assert r["audio_s_min"] == r["audio_s_max"] == 1.0, r  # 25 frames at 24 kHz, each request
        assert 0 < r["ttfa_ms_p50"] <= r["ttfa_ms_p90"] and 0 < r["rtf_p50"] <= r["rtf_p90"], r
        assert r["audio_s_per_s"] > 0 and r["start_s"] > 0, r
