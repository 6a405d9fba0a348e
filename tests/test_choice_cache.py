"""The choice cache (``cuda_graphs.choice_cache``) and the graph runner's use of it, on CPU.

Unit tests of the cache itself (round trip, keys, corrupt files, atomic and concurrent writes), then the real
``GraphRunner.warm_up`` with stand-ins at its measurement and check points (the measurements need CUDA graphs,
the GEMV triton, the decode kernels FlashInfer) and a stand-in for graph capture (``_stand_in_graphs``): a second
start reads the cache and times nothing, a cached choice that fails its check is measured again with one warning
and rewritten, a corrupt entry is measured and rewritten, a disabled cache writes nothing. The real check functions
run on CPU against a torch stand-in for the Triton GEMV and a deliberately wrong SDPA kernel. ``tests/test_gpu.py``
starts a CUDA talker twice on one cache.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import sys
import threading
import types
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from _stand_in_graphs import stand_in_capture

from higgs_talker import HiggsTalker
from higgs_talker.attention import SdpaAttention
from higgs_talker.cuda_graphs import GraphRunner
from higgs_talker.cuda_graphs import capture as capture_module
from higgs_talker.cuda_graphs import choice_cache as cc
from higgs_talker.cuda_graphs import local_mlp as local_module
from higgs_talker.cuda_graphs import runner as runner_module
from higgs_talker.cuda_graphs.kernels import ROW_LINEARS, check_decode_kernels, check_row_linears, choose_row_linears

BUCKETS = (1, 2, 4)
KEY = {"gpu": {"name": "H200", "capability": [9, 0], "sms": 132}, "torch": "2.11", "model": {"hidden": 2560},
       "dtype": "bfloat16", "buckets": [1, 2, 4], "options": {"graph_mode": "auto", "row_gemv": "auto"}}  # fmt: skip
CHOICES = {"row_linears": {"qkv": (2, 1024, 4, 2), "down": (1, 512, 2, 3)},
           "bucket_kernels": {1: "native_tc", 64: "native_tc_nosplit"},
           "auto_choice": {1: "full_decode", 64: "local_mlp"}}  # fmt: skip


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------------------------- the cache


def test_an_entry_reads_back_what_was_stored_under_its_key(tmp_path: Path) -> None:
    cache = cc.ChoiceCache(tmp_path / "choices")
    assert cache.load(KEY) is None  # no entry yet (and no directory)
    path = cache.store(KEY, CHOICES)
    assert path == tmp_path / "choices" / f"{cc.key_digest(KEY)}.json"
    assert cache.load(KEY) == CHOICES
    data = json.loads(path.read_text())
    assert data["key"] == KEY and data["format"] == cc.FORMAT  # the whole key is inside the entry
    assert data["choices"]["bucket_kernels"] == {"1": "native_tc", "64": "native_tc_nosplit"}
    assert cache.entries() == 1


def _leaves(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*prefix, i))
    else:
        yield prefix


def _changed(key: dict, where: tuple) -> dict:
    out = copy.deepcopy(key)
    node = out
    for part in where[:-1]:
        node = node[part]
    value = node[where[-1]]
    node[where[-1]] = (not value) if isinstance(value, bool) else f"{value}x" if isinstance(value, str) else (
        value + 1 if isinstance(value, int) else "set")  # fmt: skip
    return out


def test_a_change_anywhere_in_the_runners_key_is_a_miss(tiny_dir: Path, tmp_path: Path, caplog) -> None:
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=4, max_model_len=256)
    key = GraphRunner(talker.engine.runner, "auto", BUCKETS, 4).choice_key()
    for part in ("torch", "cuda", "triton", "flashinfer", "higgs_talker", "sources", "model", "dtype", "engine",
                 "buckets", "options", "gpu"):  # fmt: skip
        assert part in key, part
    assert set(key["options"]) >= {"graph_mode", "row_gemv", "row_tiles", "decode_kernel", "decode_kernels",
                                   "fuse_qk_rope"}  # fmt: skip
    assert set(key["model"]) >= {"hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                                 "codebooks"}  # fmt: skip
    cache = cc.ChoiceCache(tmp_path)
    cache.store(key, CHOICES)
    assert cache.load(key) == CHOICES
    leaves = [w for w in _leaves(key) if w[0] != "gpu"] + [("gpu",)]  # gpu is None off CUDA
    assert len(leaves) > 20
    for where in leaves:
        assert cache.load(_changed(key, where)) is None, where
    assert not warnings(caplog)  # a miss is not a problem


def test_the_runners_key_follows_options_shapes_and_versions(tiny_dir: Path, monkeypatch) -> None:
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=4, max_model_len=256)
    runner = talker.engine.runner
    base = GraphRunner(runner, "auto", BUCKETS, 4).choice_key()
    assert GraphRunner(runner, "auto", BUCKETS, 4).choice_key() == base
    assert GraphRunner(runner, "full_decode", BUCKETS, 4).choice_key()["options"]["graph_mode"] == "full_decode"
    assert GraphRunner(runner, "auto", (1, 2), 4).choice_key()["buckets"] == [1, 2, 4]  # max_batch is added
    assert GraphRunner(runner, "auto", (1, 4), 4).choice_key()["buckets"] == [1, 4]
    other = HiggsTalker.from_pretrained(tiny_dir, "cpu", "bfloat16", max_num_seqs=8, max_model_len=512)
    key = GraphRunner(other.engine.runner, "auto", BUCKETS, 8).choice_key()
    assert key["dtype"] == "bfloat16" and key["engine"]["max_num_seqs"] == 8 and key["engine"]["max_model_len"] == 512
    from higgs_talker import pdl

    monkeypatch.setattr(pdl, "ENABLED", not pdl.ENABLED)  # our kernels launched with PDL or not: timed apart
    assert GraphRunner(runner, "auto", BUCKETS, 4).choice_key()["options"]["pdl"] == pdl.ENABLED
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert GraphRunner(runner, "auto", BUCKETS, 4).choice_key()["torch"] == "9.9.9"
    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    gpu = cc.environment_key(torch.device("cuda"))["gpu"]
    assert gpu == {"name": "NVIDIA H200", "capability": [9, 0], "sms": 132}


def test_an_entry_of_another_key_is_a_miss_without_a_warning(tmp_path: Path, caplog) -> None:
    cache = cc.ChoiceCache(tmp_path)
    other = {**KEY, "torch": "2.12"}
    body = {"format": cc.FORMAT, "key": other, "choices": cc.choices_json(CHOICES)}
    cache.path(KEY).write_text(json.dumps(body))  # as if two keys hashed alike
    assert cache.load(KEY) is None and not warnings(caplog)


CORRUPT = {
    "truncated": '{"format": 1, "key": {"gpu"',
    "empty": "",
    "not utf-8": b"\xff\xfe\x00garbage",
    "a list": "[1, 2, 3]",
    "a bad tile": {"row_linears": {"qkv": [2, 1024, 4]}},
    "a bad few-row tile": {"few_row_linears": {"down": [32, 512, 4, 0]}},
    "a bad bucket": {"bucket_kernels": {"one": "native_tc"}},
    "a bad path": {"auto_choice": {"1": "fastest"}},
    "an unknown choice": {"colour": {"1": "red"}},
}


def _write_corrupt(path: Path, content, key: dict) -> None:
    if isinstance(content, dict):
        content = json.dumps({"format": cc.FORMAT, "key": key, "choices": content})
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


@pytest.mark.parametrize("content", list(CORRUPT.values()), ids=list(CORRUPT))
def test_a_corrupt_entry_is_a_miss_with_one_warning(tmp_path: Path, caplog, content) -> None:
    cache = cc.ChoiceCache(tmp_path)
    _write_corrupt(cache.path(KEY), content, KEY)
    assert cache.load(KEY) is None
    assert len(warnings(caplog)) == 1 and "cannot use" in warnings(caplog)[0]


def test_a_store_goes_through_a_temporary_file_and_a_rename(tmp_path: Path, monkeypatch, caplog) -> None:
    cache = cc.ChoiceCache(tmp_path)
    path = cache.store(KEY, CHOICES)
    old = path.read_bytes()
    real_replace, seen = os.replace, []

    def spy(src, dst):
        seen.append((Path(src), Path(dst), path.read_bytes()))  # the entry as a reader sees it just before
        real_replace(src, dst)

    monkeypatch.setattr(cc.os, "replace", spy)
    new = {"bucket_kernels": {1: "xqa"}}
    cache.store(KEY, new)
    (src, dst, before), = seen  # fmt: skip
    assert dst == path and src.parent == path.parent and src != path and before == old
    assert cache.load(KEY) == new and sorted(p.name for p in tmp_path.iterdir()) == [path.name]

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cc.os, "replace", fail)
    assert cache.store(KEY, CHOICES) is None  # a failed write: one warning, the old entry whole, no temp file left
    assert len(warnings(caplog)) == 1 and "cannot write" in warnings(caplog)[0]
    assert cache.load(KEY) == new and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_concurrent_writers_never_leave_a_partial_entry(tmp_path: Path, caplog) -> None:
    cache = cc.ChoiceCache(tmp_path)
    written = [{"bucket_kernels": {b: k for b in range(1, 200)}} for k in ("native_tc", "xqa", "native_tc_nosplit")]
    seen, stop = [], threading.Event()

    def write(choices):
        for _ in range(40):
            assert cache.store(KEY, choices) is not None

    def read():
        while not stop.is_set():
            seen.append(cache.load(KEY))

    reader = threading.Thread(target=read)
    writers = [threading.Thread(target=write, args=(c,)) for c in written]
    reader.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert not warnings(caplog)
    assert seen and all(s is None or s in written for s in seen)
    assert cache.load(KEY) in written and sorted(p.name for p in tmp_path.iterdir()) == [cache.path(KEY).name]


def test_the_option_and_the_variable_pick_the_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(cc.CHOICE_CACHE_VAR, raising=False)
    assert cc.open_choice_cache(None).directory == tmp_path / ".cache" / "higgs_talker" / "choices"
    assert cc.open_choice_cache(True).directory == tmp_path / ".cache" / "higgs_talker" / "choices"
    assert cc.open_choice_cache(tmp_path / "mine").directory == tmp_path / "mine"
    assert cc.open_choice_cache(False) is None
    monkeypatch.setenv(cc.CHOICE_CACHE_VAR, str(tmp_path / "elsewhere"))
    assert cc.open_choice_cache(None).directory == tmp_path / "elsewhere"
    for off in ("off", "0", "", "none"):
        monkeypatch.setenv(cc.CHOICE_CACHE_VAR, off)
        assert cc.open_choice_cache(None) is None
    with pytest.raises(ValueError, match="choice_cache must be a directory"):
        cc.open_choice_cache(3)
    with pytest.raises(ValueError, match="choice_cache must be a directory"):
        HiggsTalker.from_pretrained("tiny", choice_cache=["a"])


# ------------------------------------------------------------------------------ warm-up through the cache


class StandIns:
    """Stand-ins at the graph runner's measurement and check points, recording their calls; ``bad`` holds the
    choices whose check fails ((linear, tile), (bucket, kernel)); ``tiles`` / ``kernels`` what a measurement
    picks."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple] = []
        self.bad: set = set()
        self.tiles = {"qkv": (2, 1024, 4, 2), "o_proj": (2, 512, 2, 2), "gate_up": None, "down": (1, 512, 2, 3)}
        self.few_tiles = {"qkv": (64, 256, 4, 3), "o_proj": None, "gate_up": (32, 128, 4, 3), "down": (32, 512, 4, 4)}
        self.kernels = {1: "sdpa", 2: "sdpa_alt", 4: "sdpa_alt"}
        self.times = [1.0, 2.0, 3.0, 1.0, 1.0, 2.0]  # (full, local) of buckets 1, 2, 4: full, local, full
        for name in ("row_gemv_option", "choose_row_linears", "check_row_linears", "choose_decode_kernels",
                     "check_decode_kernels", "median_ms", "graph_pool"):  # fmt: skip
            monkeypatch.setattr(runner_module, name, getattr(self, name))
        monkeypatch.setattr(capture_module, "capture_graph", stand_in_capture)
        monkeypatch.setattr(local_module, "capture_graph", stand_in_capture)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def row_gemv_option(self, kernels, layers) -> str:
        return "auto"

    def choose_row_linears(self, kernels, layers, names=None, few=False):
        self.calls.append(("choose_row_linears" + ("[few]" if few else ""), names))
        table, tiles = (kernels.few_row_configs, self.few_tiles) if few else (kernels.row_configs, self.tiles)
        for name in names or list(ROW_LINEARS):
            table.pop(name, None)
            if tiles[name] is not None:
                table[name] = tiles[name]
        return [{"linear": n, "us": 1.0} for n in names or ROW_LINEARS]

    def check_row_linears(self, kernels, layers, tiles, few=False):
        self.calls.append(("check_row_linears" + ("[few]" if few else ""), dict(tiles)))
        table = kernels.few_row_configs if few else kernels.row_configs
        table.clear()
        failed = [n for n, t in tiles.items() if (n, t) in self.bad]
        table.update({n: t for n, t in tiles.items() if n not in failed})
        return [{"linear": n, "cached": True} for n in tiles], failed

    def choose_decode_kernels(self, attn, buckets, contexts=(512, 2048), tolerance=2e-2, step=None):
        self.calls.append(("choose_decode_kernels", list(buckets)))
        attn.bucket_kernel |= {b: self.kernels[b] for b in buckets}
        return [{"bucket": b, "kernel": self.kernels[b], "step_ms": 1.0} for b in buckets]

    def check_decode_kernels(self, attn, chosen):
        self.calls.append(("check_decode_kernels", dict(chosen)))
        failed = [b for b, k in chosen.items() if (b, k) in self.bad]
        attn.bucket_kernel |= {b: k for b, k in chosen.items() if b not in failed}
        return [{"bucket": b, "cached": True} for b in chosen], failed

    def median_ms(self, fn, iters=10, warmup=1):
        self.calls.append(("median_ms",))
        fn()
        return self.times.pop(0)

    def graph_pool(self):
        return types.SimpleNamespace(id="no pool on CPU")


@pytest.fixture
def stand_ins(monkeypatch) -> StandIns:
    return StandIns(monkeypatch)


def start(tiny_dir: Path, choice_cache) -> HiggsTalker:
    """A tiny CPU talker whose engine warms up in auto mode (as a CUDA start does), with two decode kernels to
    choose from and a GEMV option to choose."""
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=4, max_model_len=256)
    talker.model.kernels.row_configs, talker.model.kernels.few_row_configs = {}, {}
    attn = talker.engine.runner.attn
    attn.decode_kernels, attn.bucket_kernel = ("sdpa", "sdpa_alt"), {}
    talker.engine.warm_up("auto", BUCKETS, (), choice_cache)
    return talker


MEASURED = {"row_linears": {"qkv": (2, 1024, 4, 2), "o_proj": (2, 512, 2, 2), "down": (1, 512, 2, 3)},
            "few_row_linears": {"qkv": (64, 256, 4, 3), "gate_up": (32, 128, 4, 3), "down": (32, 512, 4, 4)},
            "bucket_kernels": {1: "sdpa", 2: "sdpa_alt", 4: "sdpa_alt"},
            "auto_choice": {1: "full_decode", 2: "local_mlp", 4: "full_decode"}}  # fmt: skip


def test_a_second_start_reads_the_cache_checks_and_times_nothing(tiny_dir, tmp_path, stand_ins, caplog) -> None:
    first = start(tiny_dir, tmp_path).engine.graphs
    assert first.choices_source == "measured" and first.choices == MEASURED
    assert stand_ins.names().count("median_ms") == 6
    assert {"choose_row_linears", "choose_row_linears[few]", "choose_decode_kernels"} <= set(stand_ins.names())
    entry = first.choice_file
    assert entry.parent == tmp_path and cc.ChoiceCache(tmp_path).load(first.choice_key()) == MEASURED
    written = entry.stat().st_mtime_ns, entry.read_bytes()

    stand_ins.calls.clear()
    talker = start(tiny_dir, tmp_path)
    graphs = talker.engine.graphs
    assert graphs.choices_source == "cached" and graphs.choices == MEASURED and graphs.choice_file == entry
    # nothing measured, nothing timed
    assert stand_ins.names() == ["check_row_linears", "check_row_linears[few]", "check_decode_kernels"]
    assert [c[1] for c in stand_ins.calls] == [
        MEASURED[k] for k in ("row_linears", "few_row_linears", "bucket_kernels")
    ]
    assert talker.model.kernels.row_configs == MEASURED["row_linears"]
    assert talker.model.kernels.few_row_configs == MEASURED["few_row_linears"]
    assert talker.engine.runner.attn.bucket_kernel == MEASURED["bucket_kernels"]
    assert graphs.choice == MEASURED["auto_choice"] and not graphs.timings
    assert sorted(graphs.full.graphs) == [1, 4] and graphs.local.sizes == (2,)  # only the cached path captured
    assert [graphs.path_for(b) for b in BUCKETS] == ["full_decode", "local_mlp", "full_decode"]
    assert (entry.stat().st_mtime_ns, entry.read_bytes()) == written  # not rewritten
    assert not warnings(caplog)
    assert talker.generate("after a cached start", max_frames=4).rows.shape[0] > 0


def test_each_warm_up_phase_logs_its_time(tiny_dir, tmp_path, stand_ins, caplog) -> None:
    """A start that takes minutes must say which phase took them (an H100 start sat for minutes after "graph
    policy" with nothing logged)."""
    caplog.set_level(logging.INFO, logger=runner_module.__name__)
    start(tiny_dir, tmp_path)
    phases = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up: ")]
    names = [m.removeprefix("warm-up: ").rsplit(" in ", 1)[0] for m in phases]
    assert names == ["one- and few-row linear tiles", "decode kernels", "full-decode graphs", "local MLP graphs",
                     "graph path per bucket"]  # fmt: skip
    assert all(float(m.rsplit(" in ", 1)[1].removesuffix(" s")) >= 0 for m in phases)  # CPU: no free memory


FAILURES = {  # a kind of choice -> what fails its check, what is measured again, the rewritten choice
    "row_linears": ({("o_proj", (2, 512, 2, 2))}, ("choose_row_linears", ["o_proj"]), {"o_proj": (1, 512, 2, 3)}),
    "few_row_linears": (
        {("gate_up", (32, 128, 4, 3))},
        ("choose_row_linears[few]", ["gate_up"]),
        {"gate_up": (64, 256, 4, 3)},
    ),
    "bucket_kernels": ({(4, "sdpa_alt")}, ("choose_decode_kernels", [4]), {4: "sdpa"}),
    "auto_choice": ({2}, None, {2: "full_decode"}),
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_a_cached_choice_that_fails_its_check_is_measured_again_once(
    tiny_dir, tmp_path, stand_ins, monkeypatch, caplog, kind
) -> None:
    start(tiny_dir, tmp_path)
    bad, measured_again, rewritten = FAILURES[kind]
    stand_ins.calls.clear()
    stand_ins.tiles["o_proj"] = (1, 512, 2, 3)
    stand_ins.few_tiles["gate_up"] = (64, 256, 4, 3)
    stand_ins.kernels[4] = "sdpa"
    if kind == "auto_choice":  # bucket 2's local MLP graph (its cached path) fails its replay-vs-eager check
        real_check = local_module.LocalMLPGraphs._check_layer

        def check_layer(self, bucket, layer):
            if bucket.size in bad:
                raise RuntimeError(f"layer {layer} replay output differs from eager")
            real_check(self, bucket, layer)

        monkeypatch.setattr(local_module.LocalMLPGraphs, "_check_layer", check_layer)
    else:
        stand_ins.bad = bad
    caplog.clear()
    graphs = start(tiny_dir, tmp_path).engine.graphs
    cache_warnings = [w for w in warnings(caplog) if w.startswith("choice cache")]
    assert len(cache_warnings) == 1, cache_warnings
    if kind != "auto_choice":  # (there the failed capture has its own warning, as any failed capture does)
        assert len(warnings(caplog)) == 1
        assert measured_again in stand_ins.calls
        assert stand_ins.names().count(measured_again[0]) == 1  # only the failed choices are measured again
    assert "median_ms" not in stand_ins.names()  # auto: bucket 2 has one path left, nothing to time
    want = copy.deepcopy(MEASURED)
    want[kind] |= rewritten
    assert graphs.choices_source == "remeasured" and graphs.choices == want
    assert cc.ChoiceCache(tmp_path).load(graphs.choice_key()) == want  # the entry is rewritten

    stand_ins.calls.clear()
    caplog.clear()
    again = start(tiny_dir, tmp_path).engine.graphs  # the rewritten choices pass: a cached start
    assert again.choices_source == "cached" and again.choices == want
    assert not [w for w in warnings(caplog) if w.startswith("choice cache")]


@pytest.mark.parametrize("content", list(CORRUPT.values()), ids=list(CORRUPT))
def test_a_corrupt_entry_is_measured_and_rewritten(tiny_dir, tmp_path, stand_ins, caplog, content) -> None:
    first = start(tiny_dir, tmp_path).engine.graphs
    _write_corrupt(first.choice_file, content, first.choice_key())
    stand_ins.calls.clear()
    stand_ins.times = [1.0, 2.0, 3.0, 1.0, 1.0, 2.0]
    caplog.clear()
    graphs = start(tiny_dir, tmp_path).engine.graphs
    assert len(warnings(caplog)) == 1 and "cannot use" in warnings(caplog)[0]
    assert graphs.choices_source == "measured" and graphs.choices == MEASURED
    assert {"choose_row_linears", "choose_decode_kernels", "median_ms"} <= set(stand_ins.names())
    assert "check_row_linears" not in stand_ins.names()
    assert cc.ChoiceCache(tmp_path).load(graphs.choice_key()) == MEASURED


def test_a_disabled_cache_writes_nothing(tiny_dir, tmp_path, stand_ins, monkeypatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(cc.CHOICE_CACHE_VAR, raising=False)
    graphs = start(tiny_dir, False).engine.graphs
    assert graphs.choices_source == "measured" and graphs.choice_file is None and graphs.choices == MEASURED
    assert not home.exists()
    monkeypatch.setenv(cc.CHOICE_CACHE_VAR, "off")
    stand_ins.times = [1.0, 2.0, 3.0, 1.0, 1.0, 2.0]
    graphs = start(tiny_dir, None).engine.graphs
    assert graphs.choices_source == "measured" and graphs.choice_file is None and not home.exists()
    monkeypatch.delenv(cc.CHOICE_CACHE_VAR)  # the default: under HOME
    stand_ins.times = [1.0, 2.0, 3.0, 1.0, 1.0, 2.0]
    graphs = start(tiny_dir, None).engine.graphs
    assert graphs.choice_file.parent == home / ".cache" / "higgs_talker" / "choices" and graphs.choice_file.is_file()


def test_nothing_to_choose_writes_nothing(tiny_dir, tmp_path) -> None:
    """CPU as it is: one decode kernel (SDPA), no GEMV option, no auto: no entry."""
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=4, max_model_len=256)
    graphs = GraphRunner(talker.engine.runner, "eager", BUCKETS, 4, (), cc.ChoiceCache(tmp_path))
    graphs.warm_up()
    assert graphs.choices_source == "none" and graphs.choice_file is None and not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------- the real checks, on CPU


class RowConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


GOOD, OFF = RowConfig(2, 1024, 4, 2), RowConfig(2, 512, 2, 2)
FEW_GOOD, FEW_OFF = RowConfig(32, 512, 4, 4), RowConfig(64, 256, 4, 3)
FEW_ROWS_SEEN = []  # the row counts the few-row stand-in was given


def _row_linear(x, weight, bias=None, config=GOOD, silu_mul=False):
    """The one-row GEMV's numerics in torch; tile ``OFF`` is 5% off."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    if silu_mul:
        gate, up = y.to(x.dtype).double().chunk(2, dim=-1)
        y = F.silu(gate) * up
    return (y * (1.05 if config == OFF else 1.0)).to(x.dtype)


def _few_rows_linear(x, weight, bias=None, config=FEW_GOOD, silu_mul=False):
    """The few-row kernel's numerics in torch; tile ``FEW_OFF`` is 5% off."""
    FEW_ROWS_SEEN.append(x.shape[0])
    return _row_linear(x, weight, bias, GOOD if config == FEW_GOOD else OFF, silu_mul)


@pytest.fixture
def torch_gemv(monkeypatch):
    """``higgs_talker.triton_gemv`` without triton: two tiles, the second wrong."""
    fake = types.SimpleNamespace(RowConfig=RowConfig, CONFIGS=(GOOD, OFF), row_linear=_row_linear, FEW_ROWS=16,
                                 FEW_ROW_CONFIGS=(FEW_GOOD, FEW_OFF), few_rows_linear=_few_rows_linear)  # fmt: skip
    monkeypatch.setitem(sys.modules, "higgs_talker.triton_gemv", fake)
    return fake


def test_check_row_linears_keeps_the_tiles_that_pass(tiny_dir, torch_gemv) -> None:
    talker = HiggsTalker.from_pretrained(tiny_dir, "cpu", "bfloat16", max_num_seqs=4, max_model_len=256)
    model = talker.model
    model.kernels.row_configs = {"gate_up": GOOD}  # from before: cleared, gate_up is not among the cached tiles
    kernels, layers = model.kernels, model.model.layers
    rows, failed = check_row_linears(kernels, layers, {"qkv": GOOD, "o_proj": OFF, "down": (9, 9, 9, 9), "nope": GOOD})
    assert failed == ["o_proj", "down", "nope"]
    assert model.kernels.row_configs == {"qkv": GOOD}
    assert [r["linear"] for r in rows] == ["qkv", "o_proj", "down", "nope"]
    assert rows[0][f"err{tuple(GOOD)}"] < torch.finfo(torch.bfloat16).eps < rows[1][f"err{tuple(OFF)}"]
    rows, failed = check_row_linears(kernels, layers, {"gate_up": GOOD, "down": GOOD})
    assert failed == [] and model.kernels.row_configs == {"gate_up": GOOD, "down": GOOD}


def test_choose_row_linears_measures_only_the_linears_it_is_given(tiny_dir, torch_gemv) -> None:
    talker = HiggsTalker.from_pretrained(tiny_dir, "cpu", "bfloat16", max_num_seqs=4, max_model_len=256)
    kernels = talker.model.kernels
    kernels.row_gemv, kernels.row_configs = "on", {"qkv": OFF, "down": OFF}  # "on": the first correct tile, untimed
    layers = talker.model.model.layers
    rows = choose_row_linears(kernels, layers, ["down"])
    assert [r["linear"] for r in rows] == ["down"] and kernels.row_configs == {"qkv": OFF, "down": GOOD}
    rows = choose_row_linears(kernels, layers)
    assert [r["linear"] for r in rows] == list(ROW_LINEARS) and kernels.row_configs == dict.fromkeys(ROW_LINEARS, GOOD)


def test_the_tiles_tried_are_in_the_key_where_the_row_option_is_on(tiny_dir, torch_gemv) -> None:
    """A choice is one of the tiles tried: another set of candidates (an edited tile list, or a benchmark's switch
    that empties one) is another key, never a cached choice that the new set would not have made."""
    talker = HiggsTalker.from_pretrained(tiny_dir, "cpu", "bfloat16", max_num_seqs=4, max_model_len=256)
    runner = GraphRunner(talker.engine.runner, "auto", BUCKETS, 4)
    assert runner.choice_key()["options"]["row_tiles"] is None  # row_gemv off: nothing tried
    talker.model.kernels.row_gemv = "auto"
    assert runner.choice_key()["options"]["row_tiles"] == {"one": [list(GOOD), list(OFF)],
                                                           "few": [list(FEW_GOOD), list(FEW_OFF)]}  # fmt: skip
    torch_gemv.FEW_ROW_CONFIGS = (FEW_GOOD,)
    assert runner.choice_key()["options"]["row_tiles"]["few"] == [list(FEW_GOOD)]


def test_the_few_row_tiles_are_checked_and_chosen_on_16_rows_in_their_own_table(tiny_dir, torch_gemv) -> None:
    talker = HiggsTalker.from_pretrained(tiny_dir, "cpu", "bfloat16", max_num_seqs=4, max_model_len=256)
    kernels = talker.model.kernels
    kernels.row_gemv, kernels.row_configs, kernels.few_row_configs = "on", {"qkv": GOOD}, {"gate_up": FEW_GOOD}
    FEW_ROWS_SEEN.clear()
    layers = talker.model.model.layers
    rows, failed = check_row_linears(kernels, layers, {"qkv": FEW_GOOD, "o_proj": FEW_OFF, "down": GOOD}, few=True)
    assert failed == ["o_proj", "down"]  # 5% off; a one-row tile is not a few-row tile
    assert kernels.few_row_configs == {"qkv": FEW_GOOD} and kernels.row_configs == {"qkv": GOOD}
    assert all(r["rows"] == 16 for r in rows) and FEW_ROWS_SEEN == [16, 16]
    rows = choose_row_linears(kernels, layers, ["down", "gate_up"], few=True)
    assert [r["linear"] for r in rows] == ["down", "gate_up"] and all(r["rows"] == 16 for r in rows)
    assert kernels.few_row_configs == {"qkv": FEW_GOOD, "down": FEW_GOOD, "gate_up": FEW_GOOD}
    assert kernels.row_configs == {"qkv": GOOD} and set(FEW_ROWS_SEEN) == {16}


class OutOfResources(Exception):
    """Named as Triton's error for a tile that needs more shared memory than the GPU has."""


@pytest.mark.parametrize("error", [OutOfResources, RuntimeError])
def test_a_tile_that_cannot_run_is_recorded_and_only_a_shared_memory_shortfall_is_not_a_warning(
    tiny_dir, torch_gemv, caplog, error
) -> None:
    """A tile that raises is recorded as failed and the next tile is tried. Triton's OutOfResources (on Hopper the
    largest few-row gate_up tile needs 240 KiB of shared memory, 227 are there) is an expected outcome of the
    search: logged as information; any other error is a warning."""
    big = RowConfig(128, 512, 8, 4)

    def few_rows(x, weight, bias=None, config=FEW_GOOD, silu_mul=False):
        if config == big:
            raise error("out of resource: shared memory, Required: 245760, Hardware limit: 232448")
        return _few_rows_linear(x, weight, bias, config, silu_mul)

    torch_gemv.FEW_ROW_CONFIGS, torch_gemv.few_rows_linear = (big, FEW_GOOD), few_rows
    talker = HiggsTalker.from_pretrained(tiny_dir, "cpu", "bfloat16", max_num_seqs=4, max_model_len=256)
    kernels = talker.model.kernels
    kernels.row_gemv, kernels.few_row_configs = "on", {}
    with caplog.at_level(logging.INFO, logger="higgs_talker.cuda_graphs.kernels"):
        rows = choose_row_linears(kernels, talker.model.model.layers, ["gate_up"], few=True)
    assert rows[0][f"failed{tuple(big)}"].startswith(f"{error.__name__}: out of resource")
    assert rows[0]["chosen"] == str(tuple(FEW_GOOD)) and kernels.few_row_configs == {"gate_up": FEW_GOOD}
    failed = [r for r in caplog.records if "failed on gate_up" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.INFO if error is OutOfResources else logging.WARNING]


class TwoSdpaKernels(SdpaAttention):
    """SDPA with a second decode kernel that is 5% off."""

    decode_kernels = ("sdpa", "off_by_5pct")

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.bucket_kernel: dict[int, str] = {}
        self._kernel = "sdpa"

    def fork(self, kv_caches):
        return TwoSdpaKernels(kv_caches, self.num_heads, self.num_kv_heads, self.head_dim, self.max_model_len, 0)

    def set_bucket_kernel(self, size: int, kernel: str) -> None:
        if kernel not in self.decode_kernels:
            raise ValueError(f"no decode kernel {kernel!r}")
        self.bucket_kernel[size] = kernel

    def plan_bucket(self, batch) -> None:
        super().plan_bucket(batch)
        self._kernel = self.bucket_kernel.get(batch.num_reqs, "sdpa")

    def forward(self, layer, q, k, v):
        return super().forward(layer, q, k, v) * (1.05 if self._kernel == "off_by_5pct" else 1.0)


def test_check_decode_kernels_keeps_the_kernels_that_pass(tiny_dir) -> None:
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=4, max_model_len=256)
    a = talker.engine.runner.attn
    attn = TwoSdpaKernels(a.kv_caches, a.num_heads, a.num_kv_heads, a.head_dim, a.max_model_len, a.scratch_block)
    rows, failed = check_decode_kernels(attn, {1: "sdpa", 2: "off_by_5pct", 4: "xqa", 3: None}, contexts=(40, 300))
    assert failed == [2, 4, 3] and attn.bucket_kernel == {1: "sdpa"}
    assert {(r["bucket"], r["context"]) for r in rows} == {(1, 40), (1, 256), (2, 40), (2, 256)}  # capped at 256
    assert all(r["ok"] == (r["bucket"] == 1) for r in rows)
    assert all(r["rel_err"] < 1e-5 for r in rows if r["bucket"] == 1)


def test_the_source_digest_follows_measured_files_only(tmp_path: Path) -> None:
    root = tmp_path / "higgs_talker"
    shutil.copytree(cc.PACKAGE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    base = cc.source_digest(root)
    assert base == cc.source_digest(cc.PACKAGE_ROOT)
    for unmeasured in ("serve/app.py", "vllm_plugin/talker.py", "cli.py"):
        edited = tmp_path / f"copy-{unmeasured.replace('/', '-')}"
        shutil.copytree(root, edited)
        (edited / unmeasured).write_text((edited / unmeasured).read_text() + "\n# edit\n")
        assert cc.source_digest(edited) == base, unmeasured
    for measured in ("model.py", "heads/triton_kernels.py", "cuda_graphs/runner.py"):
        edited = tmp_path / f"copy-{measured.replace('/', '-')}"
        shutil.copytree(root, edited)
        (edited / measured).write_text((edited / measured).read_text() + "\n# edit\n")
        assert cc.source_digest(edited) != base, measured
