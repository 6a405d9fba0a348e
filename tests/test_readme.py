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
from higgs_talker.audio import REFERENCE_SECONDS, read_wav
from higgs_talker.heads.sampling import SamplingParams

README = Path(__file__).resolve().parent.parent / "README.md"
MAX_EXAMPLE_FRAMES = 250


def code_block(section: str, language: str) -> str:
    text = README.read_text(encoding="utf-8")
    body = text[text.index(f"## {section}\n") :]
    match = re.search(rf"```{language}\n(.*?)```", body, re.DOTALL)
    assert match, f"no {language} block under '## {section}'"
    return match.group(1)


def cli_commands(text: str) -> list[list[str]]:
    """The arguments of every line of ``text`` that starts with ``higgs-talker``."""
    return [shlex.split(line, comments=True)[1:] for line in text.splitlines() if line.startswith("higgs-talker ")]


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


def test_the_first_cli_line_gives_a_recording_the_cli_section_can_clone(frames_asked: list[int], capsys) -> None:
    """The README's first higgs-talker line writes hello.wav with a fresh seed; the CLI section then clones that
    voice with --reference hello.wav (1-30 s). Without a minimum length it often wrote 0.5-0.9 s of audio."""
    text = README.read_text(encoding="utf-8")
    (first,) = cli_commands(text[: text.index("## Python API\n")])
    clone = [argv for argv in cli_commands(code_block("CLI", "bash")) if "--reference" in argv and "hello.wav" in argv]
    assert len(clone) == 1, clone
    for seed in (["--seed", "3"], [], []):  # seed 3 ends after under 1 s on its own; then fresh seeds
        assert cli.main(first + seed) == 0, capsys.readouterr().err
        samples, rate = read_wav("hello.wav")
        assert samples.shape[-1] / rate >= REFERENCE_SECONDS[0]
        assert cli.main(clone[0]) == 0, capsys.readouterr().err
    assert max(frames_asked) <= MAX_EXAMPLE_FRAMES, frames_asked


def test_cli_examples_run_and_are_short(frames_asked: list[int], capsys) -> None:
    commands = cli_commands(code_block("CLI", "bash"))
    assert len(commands) >= 4
    for argv in commands:
        rc = cli.main(argv)
        assert rc == 0, f"higgs-talker {shlex.join(argv)} exited {rc}: {capsys.readouterr().err}"
    assert frames_asked and max(frames_asked) <= MAX_EXAMPLE_FRAMES, frames_asked
    assert SamplingParams().max_frames > MAX_EXAMPLE_FRAMES  # the examples must set a cap: the default is long
