"""Ctrl-C in ``higgs-talker generate``: exit status 130, one line on stderr, no output file, at any point.

Each case runs the CLI in a child process on the tiny checkpoint with a few functions wrapped to announce, on
stderr, the stage they have reached (loading, prefill, decode, codec, writing); the test sends SIGINT when it
reads the announcement. The decode case is the one that used to abort: the engine's worker thread was still
inside a torch op when the interpreter shut down, and C++ ended the process with "terminate called without an
active exception" (SIGABRT, exit 134).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

ROOT = Path(__file__).resolve().parent.parent

# Runs in the child: wrap the stage functions, then the CLI. argv: tiny dir, stage, then the CLI's arguments.
CHILD = textwrap.dedent(
    """
    import atexit, signal, sys, time
    # a shell without job control starts background jobs with SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler (pytest run as such a job saw every case exit 0); start as from a terminal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch
    import higgs_talker.checkpoint, higgs_talker.codec.codec, higgs_talker.engine, higgs_talker.results
    from higgs_talker import cli

    stage = sys.argv[2]

    def announce(name):
        print(f"@{name}", file=sys.stderr, flush=True)

    def wrap(owner, attr, before=None, after=None):
        real = getattr(owner, attr)
        def wrapped(*args, **kwargs):
            if before:
                before()
            out = real(*args, **kwargs)
            if after:
                after()
            return out
        setattr(owner, attr, wrapped)

    def hold(name, seconds):  # announce, then stay in this stage for the signal to land in it
        def run():
            announce(name)
            time.sleep(seconds)
        return run

    steps, in_step, heavy = [0], [False], torch.rand(256, 256)
    real_step = higgs_talker.engine.Engine.step
    def step(engine):
        steps[0] += 1
        in_step[0] = True
        try:
            if stage == "prefill" and steps[0] == 1:
                hold("prefill", 0.5)()  # on the worker thread, inside the step, before the prefill itself runs
            if stage == "decode" and steps[0] > 30:
                # a real-sized model's step spends its time in many torch ops, outside the GIL; so does this one
                # (0.3 s), so the signal lands while the worker thread is inside a step, as it did in the abort
                end = time.perf_counter() + 0.3
                while time.perf_counter() < end:
                    torch.mm(heavy, heavy)
            return real_step(engine)
        finally:
            in_step[0] = False
            if stage == "decode" and steps[0] == 31:
                announce("decode")

    def exiting():  # the interpreter shuts down next: no engine step may still be running on another thread
        if in_step[0]:
            print("an engine step is still running at exit", file=sys.stderr, flush=True)
    atexit.register(exiting)

    wrap(higgs_talker.checkpoint, "load_into", before=hold("load", 5) if stage == "load" else None)
    higgs_talker.engine.Engine.step = step
    if stage == "codec":
        wrap(higgs_talker.codec.codec.Codec, "decode", before=hold("codec", 5))
    if stage == "write":  # the WAV is complete under its temporary name, not yet renamed
        wrap(higgs_talker.results, "write_wav", after=hold("write", 5))
    if stage == "import":  # an import whose body swallows what is raised in it, as torch's C++ numpy probe does
        import importlib, importlib.abc, importlib.util

        class Swallowing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path, target=None):
                return importlib.util.spec_from_loader(name, self) if name == "swallowing" else None

            def create_module(self, spec):
                return None

            def exec_module(self, module):
                try:
                    hold("import", 2)()
                except BaseException:
                    pass

        sys.meta_path.insert(0, Swallowing())
        wrap(higgs_talker.checkpoint, "load_into", before=lambda: importlib.import_module("swallowing"))
    if sys.argv[3] == "api":  # the Python API in a script: an uncaught KeyboardInterrupt ends it
        from higgs_talker import HiggsTalker, SamplingParams
        talker = HiggsTalker.from_pretrained(sys.argv[1])
        talker.generate("Long one.", SamplingParams(seed=3, min_frames=4000), max_frames=4000)
    sys.argv = ["higgs-talker", *sys.argv[3:], "--model", sys.argv[1]]
    if stage == "exit":  # the command as installed; the run is over when the interpreter's teardown starts
        atexit.register(hold("exit", 2))
        cli.command()
    sys.exit(cli.main())
    """
)


def interrupt_at(
    stage: str, tiny_dir: Path, out_dir: Path, frames: int = 4000, signals: int = 1, api: bool = False
) -> tuple[int, str]:
    """Run ``generate`` (the CLI's, or the API's in a script) until it announces ``stage``, then send SIGINT
    ``signals`` times 50 ms apart; returns (exit status, stderr without the announcements)."""
    argv = ["generate", "Long one.", "--max-frames", str(frames), "--min-frames", str(frames), "--no-progress"]
    argv = ["api"] if api else [*argv, "--seed", "3", "--out", str(out_dir / "x.wav")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tiny_dir), stage, *argv],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    lines = []
    try:
        deadline = time.monotonic() + 60
        for line in child.stderr:
            lines.append(line)
            if line.strip() == f"@{stage}":
                for i in range(signals):
                    time.sleep(0.05 if i else 0)
                    child.send_signal(signal.SIGINT)
                break
            assert time.monotonic() < deadline, f"no @{stage} after 60 s: {''.join(lines)}"
        else:
            pytest.fail(f"the child ended before reaching {stage}: {''.join(lines)}")
        _, rest = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    err = "".join(line for line in [*lines, rest] if not line.startswith("@"))
    return child.returncode, err


# frames: enough that the stage is still running when the signal comes
@pytest.mark.parametrize(
    ("stage", "frames"),
    [("load", 4000), ("prefill", 4000), ("decode", 4000), ("codec", 60), ("write", 60)],
)
def test_ctrl_c_exits_130_with_one_line_and_no_file(tiny_dir: Path, tmp_path: Path, stage: str, frames: int) -> None:
    rc, err = interrupt_at(stage, tiny_dir, tmp_path, frames)
    assert "terminate called" not in err and "Traceback" not in err, err
    assert (rc, err) == (130, "higgs-talker: interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither x.wav nor its temporary file


def test_ctrl_c_after_the_run_is_over_changes_nothing(tiny_dir: Path, tmp_path: Path) -> None:
    """A Ctrl-C in the interpreter's teardown, once the command has written its file and said so, is ignored:
    the finished run exits 0 (it was a silent 130)."""
    rc, err = interrupt_at("exit", tiny_dir, tmp_path, frames=20)
    assert (rc, err) == (0, ""), (rc, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.wav"]


def test_ctrl_c_inside_an_import_is_not_lost(tiny_dir: Path, tmp_path: Path) -> None:
    """A KeyboardInterrupt raised inside an import can be swallowed by the C code running it (torch's numpy probe)
    or leave a module half-initialised: Ctrl-C early in a run was lost (the command ran to the end, exit 0) or
    ended in an unrelated traceback ("cannot load module more than once per process"). It waits for the import."""
    rc, err = interrupt_at("import", tiny_dir, tmp_path, frames=60)
    assert (rc, err) == (130, "higgs-talker: interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_second_ctrl_c_does_not_cut_the_clean_up_short(tiny_dir: Path, tmp_path: Path) -> None:
    """``timeout -s INT`` signals the child and then its process group, so the CLI often got two; the second
    landed while the first was being handled and ended the process with the worker thread inside a step."""
    rc, err = interrupt_at("decode", tiny_dir, tmp_path, signals=2)
    assert (rc, err) == (130, "higgs-talker: interrupted\n")


def test_ctrl_c_twice_in_a_python_script(tiny_dir: Path, tmp_path: Path) -> None:
    """A script calling ``generate`` ends with Python's KeyboardInterrupt, as any script does, and no abort."""
    rc, err = interrupt_at("decode", tiny_dir, tmp_path, signals=2, api=True)
    assert "terminate called" not in err and "still running" not in err, err
    assert rc == -signal.SIGINT and err.endswith("KeyboardInterrupt\n"), (rc, err)
