"""``--require-module`` (tests/conftest.py): a suite run with it fails where it would otherwise pass by skipping.

Each case runs pytest in a subprocess on a small test file written here, with the project's conftest loaded as a
plugin, and checks the exit status and the message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PASSES = "def test_passes():\n    assert 1 + 1 == 2\n"
SKIPS = "import pytest\n\ndef test_skips():\n    pytest.skip('not here')\n"
IMPORT_SKIPS = "import pytest\n\npytest.importorskip('no_such_module_for_the_test')\n\n" + PASSES
SOME_IMPORT_SKIPS = IMPORT_SKIPS.replace("pytest.importorskip", "def test_other():\n    pytest.importorskip")


def run_pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(source)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "test_case.py", *args]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"} | {"PYTHONPATH": f"{TESTS}:{TESTS.parent}"}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("source", "rc", "message"),
    [
        (PASSES, 0, "1 passed"),
        (SKIPS, 1, "no test passed"),
        (IMPORT_SKIPS, 1, "skipped for a failed import"),
        (SOME_IMPORT_SKIPS, 1, "skipped for a failed import"),
    ],
)
def test_required_suite_fails_unless_a_test_passes_and_nothing_skips_an_import(tmp_path, source, rc, message) -> None:
    out = run_pytest(tmp_path, source, "--require-module", "json")
    assert (out.returncode, message in out.stdout) == (rc, True), out.stdout[-2000:] + out.stderr[-2000:]


def test_same_runs_pass_without_the_option(tmp_path) -> None:
    """Without the option these exit 0. (A run whose every module skips at import collects nothing: pytest's own
    exit status 5 fails it already.)"""
    for source in (SKIPS, SOME_IMPORT_SKIPS):
        out = run_pytest(tmp_path, source)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_module_that_does_not_import_stops_the_run(tmp_path) -> None:
    out = run_pytest(tmp_path, PASSES, "--require-module", "json", "--require-module", "no_such_module_for_the_test")
    assert out.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--require-module json no_such_module_for_the_test: not all of them import here" in out.stderr
    assert "No module named 'no_such_module_for_the_test'" in out.stderr


SPLIT_TESTS = "tests/test_split.py"  # a fast file to collect


def _collected(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", SPLIT_TESTS, *args],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_shards_split_the_tests_into_contiguous_disjoint_slices() -> None:
    every = _collected()
    shards = [_collected("--shard", f"{i}/3") for i in (1, 2, 3)]
    assert len(every) >= 3 and all(shards)
    assert shards[0] + shards[1] + shards[2] == every


def test_a_bad_shard_names_the_value() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", SPLIT_TESTS, "--shard", "3/2"],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0 and "--shard '3/2'" in out.stderr + out.stdout
