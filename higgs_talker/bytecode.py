"""Bytecode of the modules a start imports, kept for images that ship and write none.

Some deploy images set ``PYTHONDONTWRITEBYTECODE=1`` and install their packages without ``__pycache__`` (the H200
image of ../shared/GPU.md, torch included), so every start compiles the Python of torch, transformers and this
package from source: importing ``higgs_talker.api`` and transformers took 4.1-4.4 s that way on this project's CPU
machine and 1.9 s with their bytecode. ``higgs-talker warmup`` writes the bytecode of every module it imported
(and of the server's, where the ``serve`` extra is installed) under ``bytecode_dir()``, laid out as
``sys.pycache_prefix`` lays it out, and the ``higgs-talker`` command reads it from there on such an image. Python
checks each file against its source (modification time and size) and compiles the source where they differ, so
an out-of-date cache costs time, never correctness. Nothing here runs on ``import higgs_talker``.
"""

from __future__ import annotations

import importlib.util
import os
import py_compile
import sys
from pathlib import Path

ENV = "HIGGS_TALKER_BYTECODE"  # a directory, or "off" / "0" for none
MARKER = "higgs_talker-bytecode"  # written last: a directory without it is not read
PROBE = "torch"  # the package whose missing __pycache__ says the image ships no bytecode
# what a start imports beyond a warm-up's own load (codec off): the codec's transformers modules and the server
START_MODULES = ("higgs_talker.api", "higgs_talker.codec.model", "transformers.models.dac.modeling_dac",
                 "transformers.models.higgs_audio_v2_tokenizer.configuration_higgs_audio_v2_tokenizer",
                 "higgs_talker.serve.app", "higgs_talker.serve.serving", "uvicorn")  # fmt: skip


def bytecode_dir() -> Path | None:
    """``$HIGGS_TALKER_BYTECODE``, else ``~/.cache/higgs_talker/bytecode``; None where the variable says off."""
    value = os.environ.get(ENV)
    if value is not None and value.strip().lower() in ("", "0", "off", "false", "no"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "higgs_talker" / "bytecode"


def ships_no_bytecode(package: str = PROBE) -> bool:
    """Whether this interpreter neither writes bytecode nor finds any beside ``package``'s sources (found without
    importing it); False where the package is not installed."""
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None:
        return False
    spec = importlib.util.find_spec(package)
    origin = getattr(spec, "origin", None)
    return bool(origin) and not (Path(origin).parent / "__pycache__").is_dir()


def use_bytecode(directory: Path | None = None, probe: str = PROBE) -> Path | None:
    """Read bytecode from ``directory`` (default ``bytecode_dir()``) from now on, where ``ships_no_bytecode(probe)``
    and ``write_bytecode`` filled it; call before the heavy imports. Returns the directory read, or None."""
    try:
        directory = directory if directory is not None else bytecode_dir()
        if directory is None or not (directory / MARKER).is_file() or not ships_no_bytecode(probe):
            return None
    except (OSError, RuntimeError, ValueError):  # an unreadable directory, no home directory: start without it
        return None
    sys.pycache_prefix = str(directory)
    return directory


def import_start_modules(names: tuple[str, ...] = START_MODULES) -> list[str]:
    """Import ``names`` where installed (before ``write_bytecode``); returns the ones imported."""
    imported = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        imported.append(name)
    return imported


def write_bytecode(directory: Path | None = None) -> tuple[Path | None, int]:
    """Compile the source of every imported module into ``directory`` (default ``bytecode_dir()``), in the
    ``sys.pycache_prefix`` layout, where its file there is not already up to date; returns (the directory, modules
    with bytecode there). Sources that do not compile and directories that cannot be written are skipped: the
    cache is only ever a shortcut."""
    directory = directory if directory is not None else bytecode_dir()
    if directory is None:
        return None, 0
    sources = {f for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None)) and f.endswith(".py")}
    before, written = sys.pycache_prefix, 0
    sys.pycache_prefix = str(directory)  # cache_from_source names the file under the prefix
    try:
        for source in sorted(sources):
            try:
                cfile = importlib.util.cache_from_source(source)
                if not _up_to_date(source, cfile):
                    py_compile.compile(source, cfile=cfile, doraise=True)
                written += 1
            except (OSError, py_compile.PyCompileError, ValueError):
                continue
    finally:
        sys.pycache_prefix = before
    if written:
        (directory / MARKER).write_text(f"{sys.implementation.cache_tag}\n")
    return directory, written


def _up_to_date(source: str, cfile: str) -> bool:
    """Whether ``cfile`` is this interpreter's bytecode of ``source`` as it is now (the header Python checks:
    magic number, timestamp flags, the source's modification time and size)."""
    try:
        with open(cfile, "rb") as f:
            head = f.read(16)
        stat = os.stat(source)
    except OSError:
        return False
    words = [int.from_bytes(head[i : i + 4], "little") for i in (4, 8, 12)]
    return head[:4] == importlib.util.MAGIC_NUMBER and words == [0, int(stat.st_mtime) & 0xFFFFFFFF,
                                                                 stat.st_size & 0xFFFFFFFF]  # fmt: skip
