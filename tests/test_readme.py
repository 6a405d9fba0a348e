"""The README's examples run as written, on the tiny checkpoint, and each generation in them is short.

The Python block of "Python API" is executed; every ``higgs-talker`` line of the "CLI" block goes through
``cli.main``. A README example that ran to the default cap of 2048 frames took minutes on 2 CPU cores, so
every generate / stream call they make must ask for at most ``MAX_EXAMPLE_FRAMES`` (10 s of audio).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from higgs_talker import api, cli
from higgs_talker.heads.sampling import SamplingParams

README = Path(__file__).resolve().parent.parent / "README.md"
MAX_EXAMPLE_FRAMES = 250


def code_block(section: str, language: str) -> str:
    text = README.read_text(encoding="utf-8")
    body = text[text.index(f"## {section}\n") :]
    match = re.search(rf"```{language}\n(.*?)```", body, re.DOTALL)
    assert match, f"no {language} block under '## {section}'"
    return match.group(1)


@pytest.fixture
def frames_asked(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path, tmp_path: Path) -> list[int]:
    """Run in a temp dir with "tiny" meaning the session's checkpoint; records every generation's frame cap."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(api, "tiny_checkpoint", lambda: tiny_dir)
    asked: list[int] = []
    real_params = api.HiggsTalker._params

    def recording(self, sampling, count, max_frames):
        params = real_params(self, sampling, count, max_frames)
        asked.extend(p.max_frames for p in params)
        return params

    monkeypatch.setattr(api.HiggsTalker, "_params", recording)
    return asked


def test_python_example_runs_and_is_short(frames_asked: list[int], capsys) -> None:
    exec(compile(code_block("Python API", "python"), str(README), "exec"), {})
    assert Path("hello.npy").is_file() and Path("hello.wav").is_file()
    assert len(frames_asked) == 1 + 2 + 1 + 1 + 2  # generate, the batch of two, stream, stream_audio, two clones
    assert max(frames_asked) <= MAX_EXAMPLE_FRAMES, frames_asked
    assert "frames" in capsys.readouterr().out


def test_cli_examples_run_and_are_short(frames_asked: list[int], capsys) -> None:
    lines = [shlex.split(line, comments=True) for line in code_block("CLI", "bash").splitlines()]
    commands = [words[1:] for words in lines if words and words[0] == "higgs-talker"]
    assert len(commands) >= 4
    for argv in commands:
        rc = cli.main(argv)
        assert rc == 0, f"higgs-talker {shlex.join(argv)} exited {rc}: {capsys.readouterr().err}"
    assert frames_asked and max(frames_asked) <= MAX_EXAMPLE_FRAMES, frames_asked
    assert SamplingParams().max_frames > MAX_EXAMPLE_FRAMES  # the examples must set a cap: the default is long
