"""Shared fixtures: the tiny checkpoint (built into a temporary cache), a loaded talker, and a checkpoint writer.

Tests marked ``@pytest.mark.gpu`` are skipped when CUDA is not available.

``--require-module MODULE`` (repeatable; the Makefile passes it to the vLLM and Triton-interpreter suites) makes a
run that would only skip fail instead: MODULE must import before collection, no test or test module may skip
because an import failed (``pytest.importorskip``), and at least one test must pass.

``--shard I/N`` runs the I-th of N contiguous slices of the collected tests (1-based), so that a suite longer than
one command may run (the GPU machine's 10 minutes) goes in N calls; contiguous slices keep a module's tests, and
so its module-scoped fixtures, together where they can.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from higgs_talker.api import HiggsTalker
from higgs_talker.config import TalkerConfig
from higgs_talker.tiny import tiny_checkpoint, write_checkpoint


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak", type=int, default=None, metavar="N", help="requests in the engine soak test (default: the CI size)"
    )
    parser.addoption(
        "--require-module", action="append", default=[], metavar="MODULE",
        help="fail if MODULE does not import, if a test skips for a failed import, or if no test passes",
    )  # fmt: skip
    parser.addoption("--shard", default=None, metavar="I/N", help="run the I-th of N contiguous slices of the tests")


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 1 <= I <= N, or a usage error naming the value."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard {text!r}: expected I/N with 1 <= I <= N, such as 1/2")
    return i, n


def pytest_configure(config: pytest.Config) -> None:
    # The models under test are tiny: intra-op threads only add contention on the small CI machines.
    torch.set_num_threads(1)
    required = config.getoption("require_module")
    if required:
        check_imports(required)
        config.pluginmanager.register(RequiredSuite(required), "require-module")


def check_imports(modules: list[str]) -> None:
    """Import ``modules`` in a child interpreter (vllm_omni patches vLLM on import: not in this process) or raise
    a usage error naming them and the child's exception."""
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)"
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise pytest.UsageError(
            f"--require-module {' '.join(modules)}: not all of them import here ({last}), so the suite that needs "
            "them would only skip"
        )


class RequiredSuite:
    """Fails a run that passed nothing, or skipped something because an import failed (``--require-module``)."""

    def __init__(self, modules: list[str]) -> None:
        self.modules, self.passed, self.import_skips = modules, 0, []

    def _note(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if report.skipped and "could not import" in str(report.longrepr):
            self.import_skips.append(f"{report.nodeid}: {report.longrepr}")

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)
        self.passed += report.when == "call" and report.passed

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        problems = [f"skipped for a failed import: {s}" for s in self.import_skips]
        ran = not session.config.option.collectonly
        if ran and self.passed == 0 and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            problems.append("no test passed")
        if not problems:
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for line in problems if reporter is not None else []:
            reporter.write_line(f"--require-module {' '.join(self.modules)}: {line}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = config.getoption("shard")
    if shard:
        i, n = parse_shard(shard)
        lo, hi = len(items) * (i - 1) // n, len(items) * i // n
        config.hook.pytest_deselected(items=items[:lo] + items[hi:])
        items[:] = items[lo:hi]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def no_choice_cache():
    """No test reads or writes the user's choice cache (``~/.cache/higgs_talker/choices``): CUDA talkers measure
    their kernels as they did before it existed; nor the bytecode ``warmup`` writes. Tests of either pass their
    own directory."""
    from higgs_talker.bytecode import ENV as BYTECODE_VAR
    from higgs_talker.cuda_graphs.choice_cache import CHOICE_CACHE_VAR

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CHOICE_CACHE_VAR, "off")
        mp.setenv(BYTECODE_VAR, "off")
        yield


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny checkpoint, built into a session temp dir (never the user's ~/.cache)."""
    return tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("tiny-cache"))


@pytest.fixture(scope="session")
def talker(tiny_dir: Path) -> HiggsTalker:
    """The tiny talker on CPU in fp32, with a modest KV cache so the suite stays light."""
    return HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024)


@pytest.fixture
def make_checkpoint(tmp_path: Path):
    """``make_checkpoint(cfg, name=..., **kwargs)`` writes a complete checkpoint dir for ``cfg`` under tmp_path."""

    def make(cfg: TalkerConfig | None = None, name: str = "ckpt", **kwargs) -> Path:
        return write_checkpoint(tmp_path / name, cfg, **kwargs)

    return make
