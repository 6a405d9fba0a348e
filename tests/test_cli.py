"""The CLI: every user mistake ends with one line on stderr naming it and exit status 2, never a traceback.

Each test calls ``cli.main([...])`` in-process. Mistakes the flags alone reveal (an output path that cannot be
written, a reference that cannot be read) must be found before the model is loaded: those tests replace the
loader with one that fails the test.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import higgs_talker
from higgs_talker import cli
from higgs_talker.audio import write_wav


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> str:
    assert rc == 2, f"exit status {rc}, stderr {err!r}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    assert lines[0].startswith("higgs-talker: error: ")
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the CLI gets as far as loading a model."""

    def fail(args):
        raise AssertionError("the model was loaded before the mistake was reported")

    monkeypatch.setattr(cli, "_load", fail)


@pytest.fixture
def gen(tiny_dir: Path) -> list[str]:
    """The start of a generate command on the test session's tiny checkpoint."""
    return ["generate", "Hi.", "--model", str(tiny_dir), "--no-progress"]


# ----------------------------------------------------------------------------------------- sampling flags


def test_temperature_above_float32(capsys, gen, no_load) -> None:
    rc, _, err = run(capsys, *gen, "--temperature", "1e308")
    assert_one_line_error(rc, err, "--temperature must be a finite number", "got 1e+308")


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--temperature", "nan"], ["--temperature must be", "got nan"]),
        (["--top-p", "0"], ["--top-p must lie in (0, 1], got 0.0"]),
        (["--seed", "-1"], ["--seed must be an integer in [0, 2**63) (leave it out to draw one), got -1"]),
        (["--max-frames", "0"], ["--max-frames must be an integer > 0, got 0"]),
        (["--max-frames", "4294967296"], ["--max-frames must be at most 2147483647"]),
        (["--max-frames", "10", "--min-frames", "11"], ["--min-frames 11 is more than --max-frames 10"]),
        (["--reference-text", "words"], ["--reference-text needs --reference"]),
    ],
    ids=["temperature-nan", "top-p-0", "seed-negative", "max-frames-0", "max-frames-2e32", "min-above-max", "ref-text"],
)
def test_bad_sampling_flags(capsys, gen, no_load, flags, needles) -> None:
    rc, _, err = run(capsys, *gen, *flags)
    assert_one_line_error(rc, err, *needles)


def test_huge_top_k_is_top_k_off(capsys, gen, tmp_path: Path) -> None:
    """--top-k 10**20 used to overflow the engine's int64 store; any k >= the codebook size means off."""
    huge, off = tmp_path / "huge.npy", tmp_path / "off.npy"
    common = [*gen, "--seed", "5", "--max-frames", "12"]
    assert run(capsys, *common, "--top-k", "100000000000000000000", "--out", str(huge))[0] == 0
    assert run(capsys, *common, "--top-k", "-1", "--out", str(off))[0] == 0
    assert np.array_equal(np.load(huge), np.load(off))


def test_max_seconds_is_max_frames_at_the_frame_rate(capsys, gen, tmp_path: Path) -> None:
    seconds, frames = tmp_path / "s.npy", tmp_path / "f.npy"
    common = [*gen, "--seed", "9"]
    assert run(capsys, *common, "--max-seconds", "0.44", "--out", str(seconds))[0] == 0  # ceil(0.44 x 25) = 11
    assert run(capsys, *common, "--max-frames", "11", "--out", str(frames))[0] == 0
    assert np.array_equal(np.load(seconds), np.load(frames))


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "abc"])
def test_bad_max_seconds(capsys, gen, no_load, value) -> None:
    rc, _, err = run(capsys, *gen, "--max-seconds", value)
    assert_one_line_error(rc, err, "argument --max-seconds", repr(value))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--min-frames", "3000"], "--min-frames 3000 is more than --max-frames 2048 (the default)"),
        (["--min-seconds", "2", "--max-seconds", "1"], "--min-seconds 2 (50 frames) is more than --max-seconds 1 (25"),
        (["--min-seconds", "1", "--max-frames", "24"], "--min-seconds 1 (25 frames) is more than --max-frames 24"),
        (["--min-seconds", "1e12"], "--min-seconds 1e+12: min_frames must be an integer in [0, 2147483647]"),
        (["--min-seconds", "1", "--min-frames", "3"], "argument --min-frames: not allowed with argument --min-seconds"),
    ],
    ids=["min-frames-above-default", "seconds", "mixed", "huge-min-seconds", "both-mins"],
)
def test_min_above_max_names_both_flags_before_loading(capsys, gen, no_load, flags, needle) -> None:
    rc, _, err = run(capsys, *gen, *flags)
    assert_one_line_error(rc, err, needle)


def test_min_seconds_holds_the_end_back(capsys, gen, tmp_path: Path) -> None:
    """Seed 3 ends on its own after a few frames; --min-seconds 1 keeps it going to 25 frames (1 s at 25/s)."""
    free, held = tmp_path / "free.npy", tmp_path / "held.npy"
    common = [*gen, "--seed", "3", "--max-frames", "60"]
    assert run(capsys, *common, "--out", str(free))[0] == 0
    assert run(capsys, *common, "--min-seconds", "1", "--out", str(held))[0] == 0
    assert len(np.load(free)) < 25 <= len(np.load(held))


@pytest.mark.parametrize("argv", [["-v", "deploy-config", "default"], ["deploy-config", "default", "-v"],
                                  ["generate", "Hi.", "--verbose"], ["warmup", "-v"], ["demo", "-v"],
                                  ["serve", "-v"], ["-v", "serve"]])  # fmt: skip
def test_verbose_before_or_after_the_command(argv: list[str]) -> None:
    assert cli._build_parser().parse_args(argv).verbose is True
    assert cli._build_parser().parse_args([a for a in argv if a not in ("-v", "--verbose")]).verbose is False


@pytest.mark.parametrize("missing", [["fastapi"], ["uvicorn"], ["python_multipart", "multipart"]])
def test_serve_without_the_serve_extra_names_the_missing_package(capsys, monkeypatch, missing: list[str]) -> None:
    """One line and status 2 before any model is loaded, for each package of the extra (python-multipart used to
    pass this check and fail later, with FastAPI's traceback, once the model had loaded)."""
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: importing it raises ImportError
    rc, _, err = run(capsys, "serve", "--port", "0")
    package = "python-multipart" if "multipart" in missing else missing[0]
    assert_one_line_error(rc, err, f"({package} is missing)", "pip install -e '.[serve]'")


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--request-timeout", "0"], "--request-timeout must be > 0, got 0.0"),
     (["--max-new-tokens", "99999999999"], "--max-new-tokens must be at most 2147483647"),
     (["--max-voices", "0"], "--max-voices must be an integer >= 1, got 0"),
     (["--top-p", "2"], "--top-p must lie in (0, 1], got 2.0")],
)  # fmt: skip
def test_serve_refuses_a_bad_limit_by_its_flag_before_loading(capsys, monkeypatch, flags, message) -> None:
    """The server's limits are checked before the model loads and named by their flags (a --max-new-tokens no
    request could be given used to start, then blame every request's max_new_tokens, which the client never sent)."""
    monkeypatch.setattr("higgs_talker.api.HiggsTalker.from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    rc, _, err = run(capsys, "serve", "--port", "0", *flags)
    assert_one_line_error(rc, err, message)


def test_huge_max_seconds_names_the_flag(capsys, gen) -> None:
    rc, _, err = run(capsys, *gen, "--max-seconds", "1e12")
    assert_one_line_error(rc, err, "--max-seconds 1e+12", "max_frames must be at most 2147483647")


# ----------------------------------------------------------------------------------------- --out


def test_out_into_missing_directory(capsys, gen, no_load, tmp_path: Path) -> None:
    rc, _, err = run(capsys, *gen, "--out", str(tmp_path / "nodir" / "x.safetensors"))
    assert_one_line_error(rc, err, f"the directory {str(tmp_path / 'nodir')!r} does not exist")


def test_out_is_a_directory(capsys, gen, no_load, tmp_path: Path) -> None:
    rc, _, err = run(capsys, *gen, "--out", str(tmp_path))
    assert_one_line_error(rc, err, f"--out {str(tmp_path)!r} is a directory")


def test_out_named_like_a_file_but_a_directory(capsys, gen, no_load, tmp_path: Path) -> None:
    (tmp_path / "codes.npy").mkdir()
    rc, _, err = run(capsys, *gen, "--out", str(tmp_path / "codes.npy"))
    assert_one_line_error(rc, err, "codes.npy' is a directory")


def test_out_under_a_file(capsys, gen, no_load, tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    rc, _, err = run(capsys, *gen, "--out", str(tmp_path / "plain" / "x.npy"))
    assert_one_line_error(rc, err, f"{str(tmp_path / 'plain')!r} is not a directory")


@pytest.mark.parametrize("name", ["x.mp3", "x", "x.npz"])
def test_out_with_an_unsupported_format(capsys, gen, no_load, tmp_path: Path, name: str) -> None:
    rc, _, err = run(capsys, *gen, "--out", str(tmp_path / name))
    assert_one_line_error(rc, err, "unsupported format", "use .wav or .npy or .safetensors")


def test_out_suffix_in_any_case(capsys, gen, tmp_path: Path) -> None:
    rc, out, err = run(capsys, *gen, "--seed", "1", "--max-frames", "12", "--out", str(tmp_path / "x.WAV"))
    assert rc == 0, err
    assert (tmp_path / "x.WAV").read_bytes()[:4] == b"RIFF" and f"wrote {tmp_path / 'x.WAV'}" in out


@pytest.mark.skipif(not hasattr(os, "seteuid"), reason="needs POSIX permissions")
def test_out_in_a_read_only_directory(capsys, gen, no_load) -> None:
    root = Path(tempfile.mkdtemp())  # not under pytest's tmp dir, which other users may not traverse
    root.chmod(0o755)
    read_only = root / "ro"
    read_only.mkdir(mode=0o555)
    read_only.chmod(0o555)
    as_root = os.geteuid() == 0
    try:
        if as_root:
            os.seteuid(65534)  # root writes anywhere: try as an ordinary user, as a real user would run it
        rc, _, err = run(capsys, *gen, "--out", str(read_only / "x.npy"))
    finally:
        if as_root:
            os.seteuid(0)
        read_only.chmod(0o755)
        shutil.rmtree(root)
    assert_one_line_error(rc, err, f"--out {str(read_only / 'x.npy')!r} cannot be written", "ermission denied")


@pytest.mark.parametrize(("under", "needle"), [("", "is not a directory"), ("sub", "cannot be made: Not a directory")])
def test_demo_checks_wav_dir_before_generating(capsys, no_load, tmp_path: Path, under: str, needle: str) -> None:
    """demo --wav-dir under a file used to generate all three requests and write the codes first, then fail."""
    (tmp_path / "plain").write_text("x")
    wav_dir = tmp_path / "plain" / under if under else tmp_path / "plain"
    rc, _, err = run(capsys, "demo", "--out", str(tmp_path / "x.npy"), "--wav-dir", str(wav_dir))
    assert_one_line_error(rc, err, f"--wav-dir {str(wav_dir)!r} {needle}")
    assert not (tmp_path / "x.npy").exists()


def test_demo_checks_out_before_generating(capsys, no_load, tmp_path: Path) -> None:
    """demo --out nodir/x.npy used to generate all three requests first, then fail."""
    rc, _, err = run(capsys, "demo", "--out", str(tmp_path / "nodir" / "x.npy"))
    assert_one_line_error(rc, err, "does not exist")


# ----------------------------------------------------------------------------------------- --reference


def test_reference_is_a_directory(capsys, gen, no_load, tmp_path: Path) -> None:
    rc, _, err = run(capsys, *gen, "--reference", str(tmp_path))
    assert_one_line_error(rc, err, f"--reference {str(tmp_path)!r} is a directory")


def test_reference_neither_wav_nor_npy(capsys, gen, no_load, tmp_path: Path) -> None:
    ref = tmp_path / "ref.mp3"
    ref.write_bytes(b"ID3")
    rc, _, err = run(capsys, *gen, "--reference", str(ref))
    assert_one_line_error(rc, err, "--reference must be a .wav recording or a .npy file", "ref.mp3")


def test_reference_wav_that_is_no_wav_fails_before_loading(capsys, gen, no_load, tmp_path: Path) -> None:
    ref = tmp_path / "ref.wav"
    ref.write_bytes(b"RIFF")
    rc, _, err = run(capsys, *gen, "--reference", str(ref))
    assert_one_line_error(rc, err, "ref.wav")


@pytest.mark.parametrize(("seconds", "shown"), [(0.68, "0.68"), (31, "31.00")])
def test_reference_wav_too_short_or_long_fails_before_loading(capsys, gen, no_load, tmp_path, seconds, shown) -> None:
    ref = tmp_path / "Ref.WAV"
    write_wav(ref, np.zeros(round(seconds * 24000), np.float32), 24000)
    rc, _, err = run(capsys, *gen, "--reference", str(ref))
    assert_one_line_error(rc, err, f"--reference {str(ref)!r} lasts {shown} s", "must last 1-30 s")


def test_reference_missing(capsys, gen, no_load, tmp_path: Path) -> None:
    rc, _, err = run(capsys, *gen, "--reference", str(tmp_path / "nope.npy"))
    assert_one_line_error(rc, err, "nope.npy' does not exist")


def test_reference_npy_name_but_not_numpy(capsys, gen, no_load, tmp_path: Path) -> None:
    ref = tmp_path / "ref.npy"
    ref.write_text("1 2 3 4 5 6 7 8\n")
    rc, _, err = run(capsys, *gen, "--reference", str(ref))
    assert_one_line_error(rc, err, "ref.npy' is not a .npy file (no NumPy header)")


def test_reference_truncated(capsys, gen, no_load, tmp_path: Path) -> None:
    ref = tmp_path / "ref.npy"
    np.save(ref, np.zeros((50, 8), dtype=np.int64))
    ref.write_bytes(ref.read_bytes()[:200])
    rc, _, err = run(capsys, *gen, "--reference", str(ref))
    assert_one_line_error(rc, err, "ref.npy' holds no readable array of codes")


def test_reference_of_the_wrong_shape_after_load(capsys, gen, tmp_path: Path) -> None:
    ref = tmp_path / "ref.npy"
    np.save(ref, np.zeros((10, 7), dtype=np.int64))
    rc, _, err = run(capsys, *gen, "--reference", str(ref))
    assert_one_line_error(rc, err, "[10, 7]")


def test_text_too_long_for_the_model_is_one_line(tiny_dir: Path) -> None:
    """transformers' tokenizer first warned, on a line of its own, that the sequence 'will result in indexing
    errors' (it does not: the prompt's own check refuses it). In a child process: where transformers' log
    handler writes depends on what imported it first."""
    argv = ["generate", "a" * 5000, "--model", str(tiny_dir), "--no-progress"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "higgs_talker.cli", *argv], capture_output=True, text=True, env=env)
    assert_one_line_error(done.returncode, done.stderr, "prompt is 5003 tokens", "maximum length is 4096",
                          "--split speaks a long text in parts")  # fmt: skip


def test_a_long_text_from_stdin_is_spoken_in_parts(capsys, tiny_dir: Path, monkeypatch, tmp_path: Path) -> None:
    """``-`` reads the text from standard input; ``--split`` speaks what no one prompt holds (5,500 characters
    against the tiny model's 4096 positions) in parts, joined in order: the codes equal the API's split result."""
    from higgs_talker import HiggsTalker, SamplingParams

    text = "This is one sentence. " * 250
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    out = tmp_path / "long.npy"
    rc, stdout, err = run(capsys, "generate", "-", "--split", "--model", str(tiny_dir), "--no-progress", "--seed",
                          "5", "--max-frames", "4", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    want = HiggsTalker.from_pretrained(tiny_dir).generate(text, SamplingParams(seed=5, max_frames=4), split=True)
    assert len(want.parts) > 1 and torch.equal(torch.from_numpy(np.load(out)), want.codes)


def test_split_must_allow_a_character(capsys, gen, no_load) -> None:
    rc, _, err = run(capsys, *gen, "--split", "0")
    assert_one_line_error(rc, err, "--split 0")


def test_an_error_quotes_a_value_with_its_spaces(capsys, tiny_dir: Path) -> None:
    rc, _, err = run(capsys, "generate", "   ", "--model", str(tiny_dir), "--no-progress")
    assert_one_line_error(rc, err, "whitespace only: '   '")


def test_a_hub_id_is_told_that_nothing_is_downloaded(capsys) -> None:
    rc, _, err = run(capsys, "generate", "Hi.", "--model", "bosonai/higgs-audio-v3-tts-4b", "--no-progress")
    assert_one_line_error(rc, err, "'bosonai/higgs-audio-v3-tts-4b' does not exist", "nothing is downloaded")


# ----------------------------------------------------------------------------------------- model and device


def test_device_cpu_with_index_works(capsys, gen) -> None:
    rc, out, err = run(capsys, *gen, "--device", "cpu:0", "--max-frames", "10", "--seed", "1")
    assert rc == 0, err
    assert "frames" in out


@pytest.mark.parametrize(("device", "needle"), [("tpu", "unknown device 'tpu'"), ("cuda:99", "cuda:99")])
def test_bad_device(capsys, gen, device, needle) -> None:
    rc, _, err = run(capsys, *gen, "--device", device)
    assert_one_line_error(rc, err, needle)


def test_model_is_a_file(capsys, tiny_dir: Path) -> None:
    config = tiny_dir / "config.json"
    rc, _, err = run(capsys, "generate", "Hi.", "--model", str(config))
    assert_one_line_error(rc, err, f"checkpoint {str(config)!r} is a file")


def test_model_missing(capsys, tmp_path: Path) -> None:
    rc, _, err = run(capsys, "generate", "Hi.", "--model", str(tmp_path / "nope"))
    assert_one_line_error(rc, err, "nope' does not exist")


def test_non_utf8_config(capsys, tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["description"] = "voix française"
    (ckpt / "config.json").write_bytes(json.dumps(raw, ensure_ascii=False).encode("latin-1"))
    rc, _, err = run(capsys, "generate", "Hi.", "--model", str(ckpt))
    assert_one_line_error(rc, err, "config.json is not UTF-8 text")


def test_malformed_tokenizer(capsys, tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    (ckpt / "tokenizer.json").write_text('{"version": "1.0"}')  # JSON, but no tokenizer in it
    rc, _, err = run(capsys, "generate", "Hi.", "--model", str(ckpt))
    assert_one_line_error(rc, err, "could not load a tokenizer from")


def test_config_the_checkpoint_contradicts(capsys, tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["vocab_size"] = 10**9
    (ckpt / "config.json").write_text(json.dumps(raw))
    rc, _, err = run(capsys, "generate", "Hi.", "--model", str(ckpt))
    assert_one_line_error(rc, err, "text_config.vocab_size (1000000000) does not match the checkpoint")


# ----------------------------------------------------------------------------------------- argparse, help


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate"], "the following arguments are required: text"),
        (["generate", "Hi.", "--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
        (["generate", "Hi.", "--max-frames", "10", "--max-seconds", "1"], "not allowed with argument --max-frames"),
        (["generate", "Hi.", "--bogus"], "unrecognized arguments: --bogus"),
        (["speak"], "invalid choice: 'speak'"),
        ([], "the following arguments are required: COMMAND"),
        (["deploy-config", "fastest"], "unknown deploy profile 'fastest'"),
    ],
    ids=["no-text", "bad-int", "frames-and-seconds", "unknown-flag", "unknown-command", "no-command", "profile"],
)
def test_usage_mistakes_are_one_line(capsys, argv, needle) -> None:
    rc, _, err = run(capsys, *argv)
    assert_one_line_error(rc, err, needle)


def test_version(capsys) -> None:
    rc, out, _ = run(capsys, "--version")
    assert rc == 0
    assert out.strip() == f"higgs-talker {higgs_talker.__version__}"


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_flag_has_help() -> None:
    missing = [
        f"{p.prog} {'/'.join(a.option_strings) or a.dest}"
        for p in _parsers(cli._build_parser())
        for a in p._actions
        if not a.help and not isinstance(a, argparse._SubParsersAction)
    ]
    assert not missing, f"no help text: {missing}"


def test_the_summary_line_carries_the_seed_used(capsys, gen) -> None:
    """An unseeded run prints the seed it drew, once: passing it back reproduces the codes."""
    rc, first, err = run(capsys, *gen, "--max-frames", "6")
    assert rc == 0 and first.count(", seed ") == 1
    assert err.startswith("no --out: the audio is made and summed up, not kept")  # said as the generation starts
    seed = int(first.split(", seed ")[1].split(",")[0])
    rc, again, _ = run(capsys, *gen, "--max-frames", "6", "--seed", str(seed))
    assert rc == 0 and f"seed {seed}" in again


def test_a_good_run_writes_and_summarises(capsys, gen, tmp_path: Path) -> None:
    out = tmp_path / "codes.safetensors"
    rc, stdout, err = run(capsys, *gen, "--seed", "3", "--max-frames", "12", "--out", str(out))
    assert rc == 0, err
    assert out.is_file() and f"wrote {out}" in stdout and "frames" in stdout
    assert err == ""


@pytest.mark.skipif(sys.platform != "linux", reason="file names that are not UTF-8")
def test_an_out_name_that_is_not_utf8_is_written_and_shown(capsys, gen, tmp_path: Path) -> None:
    """--out $'\\xfd.npy' (a Latin-1 name) was written, and then printing 'wrote ...' to a strict UTF-8 stdout
    raised: the CLI said 'error: ... surrogates not allowed' and exit status 2 after writing the file."""
    out = tmp_path / os.fsdecode(b"\xfd.npy")
    rc, stdout, err = run(capsys, *gen, "--max-frames", "6", "--out", str(out))
    assert (rc, err) == (0, "") and out.is_file()
    assert f"wrote {tmp_path}/\\xfd.npy" in stdout


def test_allocator_refusal_is_one_line(capsys, gen, monkeypatch) -> None:
    """A KV cache the machine cannot hold (the engine sizes it from max_position_embeddings on CPU) ends in the
    CPU allocator's RuntimeError; the CLI reports it as one line."""
    message = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 32768008192 bytes. Error code 12 (Cannot allocate memory)"
    )

    def refuse(args):
        raise RuntimeError(message)

    monkeypatch.setattr(cli, "_load", refuse)
    rc, _, err = run(capsys, *gen)
    assert_one_line_error(rc, err, "out of memory", "32768008192 bytes")


def test_other_runtime_errors_keep_their_traceback(gen, monkeypatch) -> None:
    def broken(args):
        raise RuntimeError("an internal invariant failed")

    monkeypatch.setattr(cli, "_load", broken)
    with pytest.raises(RuntimeError, match="an internal invariant failed"):
        cli.main(gen)


# ----------------------------------------------------------------------------------------- warmup


@pytest.fixture
def kernel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel-cache variables are restored after the test (``--cache-dir`` sets them for the process); no
    bytecode is written outside a ``--cache-dir``."""
    from higgs_talker.kernel_cache import BYTECODE_VAR, CHOICE_CACHE_VAR, FLASHINFER_BASE_VAR, TRITON_VAR, TVM_FFI_VAR

    for var in (FLASHINFER_BASE_VAR, TVM_FFI_VAR, TRITON_VAR, CHOICE_CACHE_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(BYTECODE_VAR, "off")


def test_warmup_on_cpu_checks_the_checkpoint_and_compiles_nothing(capsys, tiny_dir: Path, kernel_env) -> None:
    rc, out, err = run(capsys, "warmup", str(tiny_dir), "--device", "cpu", "--max-model-len", "512")
    assert rc == 0 and err == "", err
    assert "nothing to compile" in out and "checked the checkpoint" in out


def test_warmup_cache_dir_points_every_cache_there(capsys, tiny_dir: Path, tmp_path: Path, kernel_env) -> None:
    from higgs_talker.kernel_cache import cache_dirs

    base = tmp_path / "new" / "kernels"
    rc, _, err = run(capsys, "warmup", str(tiny_dir), "--device", "cpu", "--cache-dir", str(base))
    assert rc == 0, err
    assert base.is_dir() and os.environ["FLASHINFER_WORKSPACE_BASE"] == str(base.absolute())
    assert cache_dirs() == {"flashinfer": base / ".cache" / "flashinfer", "tvm_ffi": base / ".cache" / "tvm-ffi",
                            "triton": base / ".cache" / "triton",
                            "choices": base.absolute() / ".cache" / "higgs_talker" / "choices"}  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--device", "cpu", "--graph-mode", "full_decode"], "graph_mode 'full_decode' needs a CUDA device"),
        (["--device", "cpu", "--graph-mode", "fastest"], "unknown graph mode 'fastest'"),
        (["--device", "cpu", "--dtype", "int8"], "unknown dtype 'int8'"),
        (["--device", "cpu", "--max-model-len", "0"], "max_model_len must be an integer > 0, got 0"),
        (["--device", "cpu", "--max-model-len", "x"], "argument --max-model-len: invalid int value: 'x'"),
        (["--device", "cpu", "--max-model-len", "5000"], "max_model_len=5000 is over the checkpoint's"),
        (["--device", "tpu"], "unknown device 'tpu'"),
    ],
    ids=[
        "graph-mode-on-cpu",
        "graph-mode-unknown",
        "dtype",
        "max-model-len-0",
        "max-model-len-x",
        "max-model-len-over-positions",
        "device",
    ],  # fmt: skip
)
def test_warmup_mistakes_are_one_line(capsys, tiny_dir: Path, kernel_env, flags, needle) -> None:
    rc, _, err = run(capsys, "warmup", str(tiny_dir), *flags)
    assert_one_line_error(rc, err, needle)


def test_warmup_of_a_missing_checkpoint(capsys, tmp_path: Path, kernel_env) -> None:
    rc, _, err = run(capsys, "warmup", str(tmp_path / "nope"), "--device", "cpu")
    assert_one_line_error(rc, err, "nope' does not exist")


def test_warmup_cache_dir_that_is_a_file(capsys, tiny_dir: Path, tmp_path: Path, kernel_env) -> None:
    plain = tmp_path / "plain"
    plain.write_text("x")
    rc, _, err = run(capsys, "warmup", str(tiny_dir), "--device", "cpu", "--cache-dir", str(plain))
    assert_one_line_error(rc, err, f"cache dir {str(plain)!r} is not a directory")


def test_warmup_cache_dir_after_flashinfer_was_imported(capsys, tiny_dir, tmp_path, kernel_env, monkeypatch) -> None:
    """FlashInfer fixes its cache location at import: a --cache-dir after that would be silently ignored."""
    home = tmp_path / "home"
    loaded = types.SimpleNamespace(FLASHINFER_BASE_DIR=home, FLASHINFER_CACHE_DIR=home / ".cache" / "flashinfer")
    monkeypatch.setitem(sys.modules, "flashinfer.jit.env", loaded)
    rc, _, err = run(capsys, "warmup", str(tiny_dir), "--device", "cpu", "--cache-dir", str(tmp_path / "other"))
    assert_one_line_error(rc, err, "FlashInfer is already imported", str(home / ".cache" / "flashinfer"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only machine's answer")
def test_warmup_on_cuda_without_cuda(capsys, tiny_dir: Path, kernel_env) -> None:
    rc, _, err = run(capsys, "warmup", str(tiny_dir), "--device", "cuda")
    assert_one_line_error(rc, err, "CUDA is not available")


def test_the_cli_starts_without_torch_and_the_package_names_resolve() -> None:
    """``higgs_talker.cli`` imports torch only when a command needs it (the package's names load on first use), so
    its Ctrl-C handler is in place for the second torch takes to import: a Ctrl-C there was a traceback. Every name
    in ``__all__`` still resolves, and ``from higgs_talker import *`` gives them."""
    code = (
        "import sys, higgs_talker, higgs_talker.cli\n"
        "higgs_talker.cli._build_parser()\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'imported at start'\n"
        "ns = {}\n"
        "exec('from higgs_talker import *', ns)\n"
        "assert sorted(k for k in ns if not k.startswith('__')) == sorted(higgs_talker.__all__)\n"
        "assert ns['HiggsTalker'].__module__ == 'higgs_talker.api'\n"
        "assert set(higgs_talker.__all__) <= set(dir(higgs_talker))\n"
        "try:\n"
        "    higgs_talker.nothing\n"
        "except AttributeError as exc:\n"
        "    assert 'nothing' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr


def test_the_progress_bar_counts_frames_against_max_frames(monkeypatch) -> None:
    """The talker reports delayed rows; the bar shows frames (rows less the delay ramp), full at max_frames."""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    bar = cli._Progress(60, 8, enabled=True)
    for rows, frames in ((3, 0), (7, 0), (8, 1), (37, 30), (67, 60), (70, 60)):
        bar(rows)
        assert sys.stderr.getvalue().rsplit("\r", 1)[-1].split("] ")[1].startswith(f"{frames} frames"), rows
    assert sys.stderr.getvalue().rsplit("\r", 1)[-1].startswith("[" + "#" * 30 + "]")
