"""Security: checkpoints are read as data only.

Weights come only from safetensors (never ``torch.load`` / pickle), the tokenizer is loaded without remote
code, and paths given to the CLI are opened as paths, never run by a shell or evaluated. Each test plants a
payload that would leave a marker on disk if it ever ran.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from higgs_talker.api import HiggsTalker
from higgs_talker.heads.sampling import SamplingParams

SMALL = dict(max_num_seqs=2, max_model_len=128)


class _Payload:
    """Unpickling this creates the directory ``marker``: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _forbid(*_args, **_kwargs):
    raise AssertionError("unpickling is not allowed while loading a checkpoint")


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "load", _forbid)
    monkeypatch.setattr(torch.serialization, "load", _forbid)
    monkeypatch.setattr(pickle, "load", _forbid)
    monkeypatch.setattr(pickle, "loads", _forbid)


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbid(*_args, **_kwargs):
        raise AssertionError("no process may be started")

    monkeypatch.setattr(subprocess, "Popen", forbid)
    monkeypatch.setattr(os, "system", forbid)
    monkeypatch.setattr(os, "popen", forbid)


@pytest.fixture
def tokenizer_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every ``AutoTokenizer.from_pretrained`` call's keyword arguments (the real loader still runs)."""
    from transformers import AutoTokenizer

    calls: list[dict] = []
    real = AutoTokenizer.from_pretrained

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording)
    return calls


@pytest.fixture
def ckpt(tiny_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may plant things in."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))


def test_loading_never_unpickles(ckpt: Path, no_unpickling, no_processes) -> None:
    talker = HiggsTalker.from_pretrained(ckpt, **SMALL)
    assert talker.generate("Safe.", SamplingParams(seed=0, max_frames=10)).num_frames == 10


def test_tokenizer_never_trusts_remote_code(ckpt: Path, tokenizer_calls: list[dict]) -> None:
    """Where the loader leaves the class choice to AutoTokenizer (here: tokenizer_config.json names none, so it
    reads config.json's), it never lets it trust remote code."""
    raw = json.loads((ckpt / "tokenizer_config.json").read_text())
    raw.pop("tokenizer_class")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(raw))
    talker = HiggsTalker.from_pretrained(ckpt, **SMALL)
    assert tokenizer_calls, "the loader did not go through AutoTokenizer"
    HiggsTalker.from_config(talker.cfg, tokenizer_path=ckpt, **SMALL)
    assert all(kwargs.get("trust_remote_code") is not True for kwargs in tokenizer_calls), tokenizer_calls


def test_pickle_weights_are_refused_unread(ckpt: Path, no_processes) -> None:
    marker = ckpt.parent / "unpickled"
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ValueError, match=r"only pickle checkpoints \(pytorch_model\.bin\)"):
        HiggsTalker.from_pretrained(ckpt, **SMALL)
    assert not marker.exists()


def test_pickle_disguised_as_safetensors_is_refused_unread(ckpt: Path, no_processes) -> None:
    marker = ckpt.parent / "unpickled"
    (ckpt / "model.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        HiggsTalker.from_pretrained(ckpt, **SMALL)
    assert not marker.exists()


def test_remote_code_in_checkpoint_is_never_imported(ckpt: Path, no_processes) -> None:
    """A checkpoint whose tokenizer and config name custom code (``auto_map``): the code must not run."""
    marker = ckpt.parent / "imported"
    (ckpt / "evil_tokenizer.py").write_text(
        f"import os\nos.mkdir({str(marker)!r})\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass EvilTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n"
    )
    auto_map = {"AutoConfig": "evil_tokenizer.EvilConfig", "AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    for name in ("tokenizer_config.json", "config.json"):
        raw = json.loads((ckpt / name).read_text())
        raw["auto_map"] = auto_map
        (ckpt / name).write_text(json.dumps(raw))
    try:
        HiggsTalker.from_pretrained(ckpt, **SMALL)
    except ValueError as exc:  # refusing is fine too, as long as the error says so and nothing ran
        assert "remote code" in str(exc) or "trust_remote_code" in str(exc), exc
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------------------
# CLI: paths are data


def _cli():
    if importlib.util.find_spec("higgs_talker.cli") is None:
        pytest.skip("higgs_talker.cli is not there yet")
    from higgs_talker.cli import main

    return main


HOSTILE_PATHS = [
    "$(mkdir {marker})",
    "`mkdir {marker}`",
    "x; mkdir {marker}",
    "x && mkdir {marker}",
    "|mkdir {marker}",
    "__import__('os').mkdir('{marker}')",
    "{{__import__('os').mkdir('{marker}')}}",
    "%(mkdir {marker})s",
]


@pytest.mark.parametrize("template", HOSTILE_PATHS)
@pytest.mark.parametrize("option", ["--model", "--reference", "--out"])
def test_cli_paths_are_not_executed(
    template: str, option: str, tiny_dir: Path, tmp_path: Path, monkeypatch, no_processes, no_unpickling
) -> None:
    main = _cli()
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "executed"
    hostile = template.format(marker=marker)
    args = ["generate", "Hi.", "--model", str(tiny_dir), "--max-frames", "9", "--seed", "1", "--no-progress"]
    if option == "--model":
        args[3] = hostile
    else:
        args += [option, hostile]
    rc = main(args)
    assert not marker.exists(), f"{option} {hostile!r} was executed"
    if option == "--out":
        # an odd output name is only ever a file name (or refused)
        written = [p for p in tmp_path.rglob("*") if p.is_file()]
        assert rc in (0, 2)
        assert rc == 2 or written, "the CLI claimed success without writing the output"
    else:
        assert rc == 2


def test_cli_reference_with_pickled_objects_is_refused(
    tmp_path: Path, tiny_dir: Path, monkeypatch, no_processes
) -> None:
    """``--reference`` .npy files are read with allow_pickle=False: an object array is an error, not code."""
    main = _cli()
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "unpickled"
    evil = tmp_path / "ref.npy"
    np.save(evil, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    rc = main(["generate", "Hi.", "--model", str(tiny_dir), "--reference", str(evil), "--no-progress"])
    assert rc == 2
    assert not marker.exists()


def test_cli_normal_run_starts_no_process(tmp_path: Path, tiny_dir: Path, monkeypatch, no_processes, no_unpickling):
    main = _cli()
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "codes.npy"
    args = ["generate", "Hi.", "--model", str(tiny_dir), "--max-frames", "12", "--seed", "3", "--no-progress"]
    assert main([*args, "--out", str(out)]) == 0
    assert np.load(out, allow_pickle=False).shape[1] == 8
