"""The bytecode ``higgs-talker warmup`` keeps for images that ship and write none (``higgs_talker.bytecode``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from higgs_talker import bytecode
from higgs_talker.cli import main

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, src: Path, prefix: Path, **env: str) -> str:
    """``code`` in a fresh interpreter that writes no bytecode (``PYTHONDONTWRITEBYTECODE``, as the H200 image),
    with ``src`` and this checkout on its path; its stdout."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPYCACHEPREFIX", bytecode.ENV))}
    environ |= {"PYTHONPATH": os.pathsep.join([str(src), str(REPO)]), "PYTHONDONTWRITEBYTECODE": "1",
                bytecode.ENV: str(prefix)} | env  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """A module ``bmod`` (X = 1) and a package ``shipped_bare`` without ``__pycache__`` (the probe: an image that
    ships no bytecode)."""
    (tmp_path / "src" / "shipped_bare").mkdir(parents=True)
    (tmp_path / "src" / "shipped_bare" / "__init__.py").write_text("")
    (tmp_path / "src" / "bmod.py").write_text("X = 1\n")
    return tmp_path / "src"


def test_the_bytecode_written_is_the_bytecode_read(src: Path, tmp_path: Path) -> None:
    """One interpreter imports ``bmod`` and writes the bytecode of its modules (``write_bytecode``); then ``bmod``'s
    source changes to X = 2 with the same size and modification time, which Python's check of a bytecode file
    against its source cannot see. An interpreter that reads the written bytecode (``use_bytecode``) gets X = 1:
    it read the file written; one that does not (no marker, bytecode shipped, or bytecode written anyway) gets 2."""
    prefix = tmp_path / "bytecode"
    out = _python("import bmod; from higgs_talker.bytecode import write_bytecode; print(write_bytecode()[1])", src,
                  prefix)  # fmt: skip
    assert int(out) > 1 and (prefix / bytecode.MARKER).is_file()
    stat = (src / "bmod.py").stat()
    (src / "bmod.py").write_text("X = 2\n")
    os.utime(src / "bmod.py", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    read = "from higgs_talker.bytecode import use_bytecode; d = use_bytecode(probe={!r}); import bmod; print(d, bmod.X)"
    assert _python(read.format("shipped_bare"), src, prefix) == f"{prefix} 1"
    assert _python(read.format("shipped_bare"), src, prefix, PYTHONDONTWRITEBYTECODE="") == "None 2"
    assert _python(read.format("json"), src, prefix).endswith(" 2")  # json's bytecode ships beside it
    (prefix / bytecode.MARKER).unlink()
    assert _python(read.format("shipped_bare"), src, prefix) == "None 2"


def test_warmup_writes_the_bytecode_of_a_start(capsys, tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """``higgs-talker warmup`` (CPU: the checkpoint checked) writes the bytecode of what a start imports, the API
    and the codec's modules among it, where ``$HIGGS_TALKER_BYTECODE`` says, and names the directory."""
    monkeypatch.setenv(bytecode.ENV, str(tmp_path / "bc"))
    assert main(["warmup", str(tiny_dir), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"modules in {tmp_path / 'bc'}" in out
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "bc"))
    import importlib.util

    import higgs_talker.api
    import higgs_talker.codec.model

    for module in (higgs_talker.api, higgs_talker.codec.model, bytecode):
        assert Path(importlib.util.cache_from_source(module.__file__)).is_file(), module.__name__


@pytest.mark.parametrize(("value", "want"), [(None, "home"), ("off", None), ("0", None), ("", None), ("~/bc", "bc")])
def test_bytecode_dir(monkeypatch, value, want) -> None:
    if value is None:
        monkeypatch.delenv(bytecode.ENV, raising=False)
    else:
        monkeypatch.setenv(bytecode.ENV, value)
    got = bytecode.bytecode_dir()
    expected = {"home": Path.home() / ".cache" / "higgs_talker" / "bytecode", "bc": Path.home() / "bc"}.get(want)
    assert got == expected


def test_an_unusable_bytecode_directory_is_passed_over(tmp_path: Path, monkeypatch) -> None:
    """A start never fails on the cache: an unreadable directory or no home directory means none is read."""
    locked = tmp_path / "locked"
    (locked / "bc").mkdir(parents=True)
    (locked / "bc" / bytecode.MARKER).write_text("x")
    monkeypatch.setattr(bytecode, "ships_no_bytecode", lambda probe=bytecode.PROBE: True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setenv(bytecode.ENV, str(locked / "bc"))
    assert bytecode.use_bytecode() == locked / "bc" and sys.pycache_prefix == str(locked / "bc")
    sys.pycache_prefix = None
    monkeypatch.setattr(Path, "is_file", lambda self: (_ for _ in ()).throw(PermissionError(13, "denied")))
    assert bytecode.use_bytecode() is None and sys.pycache_prefix is None
    monkeypatch.delenv(bytecode.ENV)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    assert bytecode.use_bytecode() is None
