"""What a warm-up chose, kept between processes: one small JSON file per key in a cache directory.

A CUDA warm-up measures four things before it captures graphs: the tile of each linear's one-row and few-row Triton
kernels (``kernels.choose_row_linears``), the decode kernel of each bucket (``kernels.choose_decode_kernels``) and,
in ``auto``, the graph path of each bucket (``runner.GraphRunner._choose``). On the 4B shape that is minutes on a
fresh H200 and seconds on every later start, for the same answers. This module keeps the answers (not only the
timings): ``{"row_linears": {linear: tile}, "few_row_linears": {linear: tile}, "bucket_kernels": {bucket: kernel},
"auto_choice": {bucket: path}}``, each present where warm-up had that choice to make.

The key is everything that could change an answer: the GPU (name, compute capability, SM count), the versions of
torch, CUDA, triton, FlashInfer and higgs_talker (with a digest of the sources a measurement runs, so an edited
kernel is measured again; the server, the vLLM plugin, the codec and the API's text handling are left out of it),
and what the graph runner adds (model shape, dtype, engine sizes, buckets, options). The file name is a hash of the
key's canonical JSON; the file holds the whole key, so a collision reads as a miss.

A cached choice is still checked before use, as a measured one is (``GraphRunner.warm_up``); only the timing is
skipped. ``load`` never raises: a file it cannot read or parse gives one warning and a miss, and the start
measures and rewrites it. ``store`` writes a temporary file in the same directory and renames it over the entry
(``os.replace``), so a reader sees the old file or the new one, whole; of two processes storing at once, the last
rename wins.

Where: ``open_choice_cache(option)`` (the API's ``choice_cache``): a directory, False for none, None for the
default, which is ``$HIGGS_TALKER_CHOICE_CACHE`` (``off`` turns the cache off) or ``~/.cache/higgs_talker/choices``.
``kernel_cache.use_cache_dir(base)`` moves it under ``base`` with the kernel caches.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CHOICE_CACHE_VAR = "HIGGS_TALKER_CHOICE_CACHE"
DEFAULT_DIR = "~/.cache/higgs_talker/choices"
OFF_VALUES = ("", "0", "off", "false", "no", "none")
FORMAT = 1  # the file layout; part of the hashed name, so a new layout never reads an old file
GRAPH_PATHS = ("full_decode", "local_mlp")
Choices = dict[str, dict]


def default_choice_dir() -> Path | None:
    """``$HIGGS_TALKER_CHOICE_CACHE`` (None where it says off), else ``~/.cache/higgs_talker/choices``."""
    value = os.environ.get(CHOICE_CACHE_VAR)
    if value is None:
        return Path(DEFAULT_DIR).expanduser()
    if value.strip().lower() in OFF_VALUES:
        return None
    return Path(value).expanduser()


def open_choice_cache(option: str | os.PathLike | bool | None = None) -> ChoiceCache | None:
    """The cache the ``choice_cache`` option names: a directory; None or True: ``default_choice_dir()``; False: none."""
    if option is False:
        return None
    if option is None or option is True:
        path = default_choice_dir()
        return None if path is None else ChoiceCache(path)
    if isinstance(option, str | os.PathLike) and str(option):
        return ChoiceCache(option)
    raise ValueError(f"choice_cache must be a directory, True, False or None, got {option!r}")


def canonical(key: dict) -> str:
    """The key as one JSON string: sorted keys, no spaces (raises TypeError for a value JSON cannot hold)."""
    return json.dumps(key, sort_keys=True, separators=(",", ":"), allow_nan=False)


def key_digest(key: dict) -> str:
    """24 hex digits of the SHA-256 of the format and the canonical key: the entry's file name."""
    return hashlib.sha256(f"{FORMAT}:{canonical(key)}".encode()).hexdigest()[:24]


def _version(module: str, distribution: str) -> str | None:
    """The version of ``module`` where it is imported, else of its installed distribution; None if neither."""
    loaded = sys.modules.get(module)
    version = getattr(loaded, "__version__", None)
    if version is not None:
        return str(version)
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


PACKAGE_ROOT = Path(__file__).resolve().parent.parent
# sources that no warm-up measurement runs: an edit there keeps the cached choices
UNMEASURED = ("serve/", "vllm_plugin/", "codec/", "api.py", "cli.py", "splitting.py", "audio.py", "results.py")


@lru_cache(maxsize=2)
def source_digest(root: Path = PACKAGE_ROOT) -> str:
    """16 hex digits over the ``.py`` files under ``root`` (path and bytes) except ``UNMEASURED``: changes with any
    edit of a file that a warm-up measurement runs."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if not name.startswith(UNMEASURED):
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def environment_key(device: torch.device) -> dict:
    """The GPU and software versions a measurement depends on (``gpu`` is None off CUDA)."""
    from .. import __version__

    gpu = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        gpu = {"name": p.name, "capability": [p.major, p.minor], "sms": p.multi_processor_count}
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton", "triton"),
        "flashinfer": _version("flashinfer", "flashinfer-python"),
        "higgs_talker": __version__,
        "sources": source_digest(),
    }


# the choices that are tiles of a linear: the one-row kernel's and the few-row kernel's
TILE_STAGES = ("row_linears", "few_row_linears")


def check_choices(raw: object) -> Choices:
    """Choices as parsed JSON -> ``{"row_linears" / "few_row_linears": {name: (4 ints)}, "bucket_kernels":
    {bucket: name}, "auto_choice": {bucket: path}}`` (stages absent stay absent); ValueError for anything else."""
    if not isinstance(raw, dict):
        raise ValueError(f"choices must be an object, got {type(raw).__name__}")
    out: Choices = {}
    for stage, table in raw.items():
        if stage not in (*TILE_STAGES, "bucket_kernels", "auto_choice") or not isinstance(table, dict):
            raise ValueError(f"unknown choice {stage!r} or not an object: {table!r:.80}")
        if stage in TILE_STAGES:
            tiles = {name: tuple(t) if isinstance(t, list) else t for name, t in table.items()}
            for name, tile in tiles.items():
                if not (isinstance(tile, tuple) and len(tile) == 4 and all(type(v) is int and v > 0 for v in tile)):
                    raise ValueError(f"{stage}: the tile of {name!r} must be 4 integers > 0, got {tile!r:.80}")
            out[stage] = tiles
            continue
        by_bucket = {}
        for bucket, value in table.items():
            if not (isinstance(bucket, str) and bucket.isdigit() and int(bucket) > 0 and isinstance(value, str)):
                raise ValueError(f"{stage}: expected bucket -> name, got {bucket!r}: {value!r:.80}")
            if stage == "auto_choice" and value not in GRAPH_PATHS:
                raise ValueError(f"auto_choice: bucket {bucket} has path {value!r}, not one of {GRAPH_PATHS}")
            by_bucket[int(bucket)] = value
        out[stage] = by_bucket
    return out


def choices_json(choices: Choices) -> dict:
    """Choices as JSON holds them: bucket keys as strings, tiles as lists."""
    return {
        stage: {str(k): list(v) if isinstance(v, tuple) else v for k, v in sorted(table.items())}
        for stage, table in choices.items()
    }


class ChoiceCache:
    """One directory of entries, ``<key_digest>.json`` each: ``{"format", "key", "choices"}``."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory).expanduser()

    def __repr__(self) -> str:
        return f"ChoiceCache({str(self.directory)!r})"

    def path(self, key: dict) -> Path:
        return self.directory / f"{key_digest(key)}.json"

    def load(self, key: dict) -> Choices | None:
        """The choices stored under ``key``; None for no entry, another key's entry (a collision), or a file that
        cannot be read or parsed (then with one warning)."""
        path = self.path(key)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("key"), dict):
                raise ValueError(f"not a choice-cache entry of format {FORMAT}")
            if canonical(data["key"]) != canonical(key):
                logger.info("choice cache: %s holds another key (a hash collision); measuring", path)
                return None
            return check_choices(data.get("choices"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            logger.warning("choice cache: cannot use %s (%s: %s); measuring instead, and the entry is rewritten",
                           path, type(exc).__name__, exc)  # fmt: skip
            return None

    def store(self, key: dict, choices: Choices) -> Path | None:
        """Write the entry atomically (a temporary file renamed over it); returns its path, or None (with one
        warning) where the directory cannot be written."""
        path = self.path(key)
        body = json.dumps({"format": FORMAT, "key": key, "choices": choices_json(choices)}, indent=1, sort_keys=True)
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=self.directory)
            with os.fdopen(fd, "w") as f:
                f.write(body + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            logger.warning("choice cache: cannot write %s (%s); the next start measures again", path, exc)
            return None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        return path

    def entries(self) -> int:
        """How many entries the directory holds (0 where it does not exist)."""
        return sum(1 for _ in self.directory.glob("*.json")) if self.directory.is_dir() else 0
