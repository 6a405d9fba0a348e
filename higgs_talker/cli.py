"""``higgs-talker``: text to codes or audio from the command line, the demo, kernel warm-up, the deploy profiles.

Paths given on the command line are only opened as files or directories; nothing is executed or evaluated.
A user mistake (a bad flag value, a path that cannot be read or written, a bad checkpoint) ends with one line on
stderr naming it and exit status 2, before any generation starts where it can be known then; internal errors
keep their traceback. Ctrl-C ends with one line and exit status 130, once the engine's step in flight is over
(a later Ctrl-C is ignored until then); files are written under a temporary name and renamed, so none is left
half-written.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import __version__
from .bytecode import use_bytecode
from .splitting import DEFAULT_PART_CHARS

OUT_FORMATS = (".wav", ".npy", ".safetensors")  # what GenerationResult.save writes
REFERENCE_FORMATS = (".wav", ".npy")  # what _read_reference reads: a recording, or its codes


class _UsageError(Exception):
    """A command-line mistake argparse found; main() prints it as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints the whole usage block first
        raise _UsageError(f"{message} (see {self.prog} --help)")


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="higgs-talker", description="Higgs-Audio V3 talker: text -> speech (codec codes, decoded)")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    # -v after the command too; SUPPRESS: a command that is not given -v leaves the value before it alone
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_command(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[verbose], **kwargs)

    g = add_command("generate", help="speak a text into a WAV file (or keep its codes)")
    g.add_argument("text", help="the text to speak; - reads it from standard input")
    g.add_argument(
        "--split",
        nargs="?",
        const=DEFAULT_PART_CHARS,
        type=int,
        metavar="CHARS",
        help=f"speak a long text in parts of at most CHARS characters (default {DEFAULT_PART_CHARS}), cut at sentence "
        "ends and joined in order, as the server does",
    )
    _add_model_args(g)
    g.add_argument(
        "--out",
        type=Path,
        metavar="PATH",
        help="write the audio to a .wav file (24 kHz mono 16-bit), or the codes to a .npy or .safetensors file",
    )
    g.add_argument("--seed", type=int, metavar="N", help="seed in [0, 2**63) for reproducible codes (default: fresh)")
    g.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 is greedy (default 1)")
    g.add_argument("--top-k", type=int, default=-1, metavar="K", help="keep the K most likely codes (-1, 0: off)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default 1: off)")
    length = g.add_mutually_exclusive_group()
    length.add_argument(
        "--max-frames",
        type=int,
        metavar="N",
        help="most audio frames (rows of the output codes, 25 per second of audio; default 2048 = 82 s)",
    )
    length.add_argument(
        "--max-seconds",
        type=_seconds,
        metavar="S",
        help="most seconds of audio, instead of --max-frames (S x 25 frames)",
    )
    shortest = g.add_mutually_exclusive_group()
    shortest.add_argument(
        "--min-frames", type=int, metavar="N", help="no end of stream before N audio frames (default 0)"
    )
    shortest.add_argument(
        "--min-seconds",
        type=_seconds,
        metavar="S",
        help="no end of stream before S seconds of audio, instead of --min-frames (S x 25 frames)",
    )
    g.add_argument(
        "--reference",
        type=Path,
        metavar="PATH",
        help="voice to clone: a .wav recording (1-30 s), or its aligned codes [T, 8] in a .npy file",
    )
    g.add_argument("--reference-text", metavar="TEXT", help="what the reference says (needs --reference)")
    g.add_argument(
        "--audio-tokenizer",
        type=Path,
        metavar="DIR",
        help="an audio tokenizer directory that encodes a --reference recording (default: the bundled codec)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")

    d = add_command("demo", help="run three batched requests end to end (the tiny checkpoint by default)")
    _add_model_args(d)
    d.add_argument(
        "--out",
        type=Path,
        default=Path("higgs_demo_codes.npy"),
        metavar="PATH",
        help=f"where the first request's result goes: {' or '.join(OUT_FORMATS)} (.wav: its audio; the others: its "
        "codes; default higgs_demo_codes.npy)",
    )
    d.add_argument(
        "--wav-dir", type=Path, default=Path("."), metavar="DIR", help="where higgs_demo_<i>.wav go (default: .)"
    )

    w = add_command(
        "warmup", help="build every GPU kernel a checkpoint needs, ahead of the first start (CUDA; no-op on CPU)"
    )
    w.add_argument("model", nargs="?", default="tiny", metavar="CHECKPOINT", help="checkpoint directory, or 'tiny'")
    w.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available, else cpu)")
    w.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on CUDA, fp32 on CPU)")
    w.add_argument("--graph-mode", default=None, metavar="MODE", help="eager, local_mlp, full_decode or auto (CUDA)")
    w.add_argument(
        "--max-model-len", type=int, metavar="N", help="longest sequence the engine serves (default: the checkpoint's)"
    )
    w.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="keep the kernels in DIR/.cache/{flashinfer,tvm-ffi,triton}, the measured kernel and graph choices "
        "in DIR/.cache/higgs_talker/choices and the imports' bytecode in DIR/.cache/higgs_talker/bytecode for this "
        "process (sets FLASHINFER_WORKSPACE_BASE=DIR, TVM_FFI_CACHE_DIR, TRITON_CACHE_DIR, HIGGS_TALKER_CHOICE_CACHE "
        "and HIGGS_TALKER_BYTECODE; default: theirs, ~/.cache/..., ~/.triton/cache, ~/.cache/higgs_talker/...)",
    )

    c = add_command("deploy-config", help="print the path of a vLLM deploy profile")
    c.add_argument("profile", help="high-throughput, low-latency, full-decode or default")

    # serve: the OpenAI-compatible speech server (higgs_talker/serve; needs the 'serve' extra)
    from .serve.options import add_arguments as add_serve_arguments

    add_serve_arguments(add_command("serve", help="an OpenAI-compatible speech server: POST /v1/audio/speech"))
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", metavar="DIR", help="checkpoint directory, or 'tiny' (the default)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--graph-mode", default=None, metavar="MODE", help="eager, local_mlp, full_decode or auto (CUDA)")


def _seconds(text: str) -> float:
    """argparse type of --max-seconds: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def _check_out(path: Path, flag: str = "--out", formats: tuple[str, ...] = OUT_FORMATS) -> Path:
    """An output path that ``GenerationResult.save`` can write; checked before anything is generated."""
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; give a file name such as {str(path / 'codes.npy')!r}")
    if path.suffix.lower() not in formats:
        raise ValueError(
            f"{flag} {str(path)!r}: unsupported format {path.suffix or '(no suffix)'!r}; use {' or '.join(formats)}"
        )
    parent = path.parent
    if not parent.is_dir():
        what = (
            f"{str(parent)!r} is not a directory"
            if parent.exists()
            else f"the directory {str(parent)!r} does not exist"
        )
        raise ValueError(f"{flag} {str(path)!r}: {what}")
    try:  # the permissions that count are the file system's (read-only mounts, ACLs, root), so try it
        with tempfile.TemporaryFile(dir=parent):
            pass
        if path.exists():
            with open(path, "r+b"):
                pass
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r} cannot be written: {exc.strerror or exc}") from None
    return path


def _shown(path: Path) -> str:
    """``path`` as any UTF-8 stdout can print it: bytes of a name that are not UTF-8 show as \\xNN (printed as they
    are, the surrogates Python decodes them to made a strict stdout raise after the file was written)."""
    return str(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _check_wav_dir(path: Path) -> None:
    """``demo --wav-dir``: made if missing and tried for writing, before anything is generated."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--wav-dir {str(path)!r} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--wav-dir {str(path)!r} cannot be made: {exc.strerror or exc}") from None
    _check_out(path / "higgs_demo_0.wav", "--wav-dir")


def _read_reference(path: Path, text: str | None):
    """``--reference``: a ``.wav`` recording (encoded by the codec when the prompt is built), or its codes [T, 8]
    in a ``.npy`` file (``allow_pickle=False``: an object array is refused)."""
    from .api import Reference

    if path.is_dir():
        raise ValueError(f"--reference {str(path)!r} is a directory, not a recording or a file of codes")
    if path.suffix.lower() not in REFERENCE_FORMATS:
        raise ValueError(f"--reference must be a .wav recording or a .npy file of codes [T, 8], got {str(path)!r}")
    if not path.is_file():
        raise ValueError(f"--reference {str(path)!r} does not exist")
    if path.suffix.lower() == ".wav":
        from .audio import REFERENCE_SECONDS, read_wav

        samples, rate = read_wav(path)  # a file that is no WAV, or too short or long, fails here, before the load
        seconds, (lo, hi) = samples.shape[-1] / rate, REFERENCE_SECONDS
        if not lo <= seconds <= hi:
            raise ValueError(f"--reference {str(path)!r} lasts {seconds:.2f} s; a reference recording must last "
                             f"{lo:g}-{hi:g} s")  # fmt: skip
        return Reference(audio=path, text=text)
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            raise ValueError(f"--reference {str(path)!r} is not a .npy file (no NumPy header)")
    try:
        import numpy as np

        return Reference(np.load(path, allow_pickle=False), text)
    except (ValueError, EOFError) as exc:  # truncated, or an object array (never unpickled)
        raise ValueError(f"--reference {str(path)!r} holds no readable array of codes: {exc}") from None


def _load(args):
    from .api import HiggsTalker

    return HiggsTalker.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        graph_mode=args.graph_mode,
        audio_tokenizer=getattr(args, "audio_tokenizer", None),
    )


class _Progress:
    """A one-line progress bar on stderr: audio frames so far against ``total`` (``max_frames``). The talker
    reports delayed rows; frame t is known once row t + C - 1 is (the delay pattern's ramp)."""

    def __init__(self, total: int, num_codebooks: int, enabled: bool, note: str | None = None) -> None:
        self.total, self.ramp, self.note = total, num_codebooks - 1, note
        self.enabled, self.start = enabled and sys.stderr.isatty(), time.perf_counter()

    def __call__(self, rows: int) -> None:
        if self.note is not None:  # once, on its own line, before the bar
            print(self.note, file=sys.stderr, flush=True)
            self.note = None
        if not self.enabled:
            return
        width, frames = 30, min(max(rows - self.ramp, 0), self.total)
        filled = min(width, int(width * frames / max(self.total, 1)))
        rate = frames / max(time.perf_counter() - self.start, 1e-9)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {frames} frames, {rate:.0f} frames/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _generate(args) -> int:
    # everything the flags alone decide is checked before the (possibly slow) model load
    params = _sampling(args)
    if args.split is not None and args.split < 1:
        raise ValueError(f"--split {args.split}: a part must hold at least one character")
    text = sys.stdin.read() if args.text == "-" else args.text
    if args.out is not None:
        _check_out(args.out)
    reference = None
    if args.reference is not None:
        reference = _read_reference(args.reference, args.reference_text)
    elif args.reference_text is not None:
        raise ValueError("--reference-text needs --reference")
    talker = _load(args)
    from .prompt import PromptTooLong

    # said once the first row is made (every check passed), not after a generation that may be long
    note = None
    if args.out is None:
        note = f"no --out: the audio is made and summed up, not kept (--out FILE: {', '.join(OUT_FORMATS)})"
    progress = _Progress(params.max_frames, talker.cfg.num_codebooks, not args.no_progress, note)
    try:
        result = talker.generate(text, params, reference=reference, progress=progress, split=args.split or False)
    except PromptTooLong as exc:
        hint = "" if args.split else "; --split speaks a long text in parts"
        raise ValueError(f"{exc}{hint}") from None
    finally:
        progress.close()
    if args.out is not None:
        result.save(args.out)
        print(f"wrote {_shown(args.out)}")
    print(result.summary())
    return 0


_SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
                   "max_frames": "--max-frames", "min_frames": "--min-frames"}  # fmt: skip


def _sampling(args):
    """The ``SamplingParams`` the flags give; --max-seconds / --min-seconds count at the checkpoint's frame rate."""
    from .heads.sampling import SamplingParams

    default = SamplingParams().max_frames
    lengths = {"max": (default, f"--max-frames {default} (the default)"), "min": (0, "")}  # frames, as given
    rate = None
    for end, frames, seconds in (
        ("max", args.max_frames, args.max_seconds),
        ("min", args.min_frames, args.min_seconds),
    ):
        if seconds is not None:
            rate = rate or _frame_rate(args.model)
            frames = math.ceil(seconds * rate)
            lengths[end] = (frames, f"--{end}-seconds {seconds:g} ({frames} frames)")
        elif frames is not None:
            lengths[end] = (frames, f"--{end}-frames {frames}")
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            max_frames=lengths["max"][0],
            min_frames=lengths["min"][0],
        )
    except ValueError as exc:
        given = [flag.split(" (")[0] for _, flag in lengths.values() if "-seconds" in flag]
        if given:
            raise ValueError(f"{', '.join(given)}: {exc}") from None
        field, _, rest = str(exc).partition(" ")  # SamplingParams names its field first: say the flag instead
        if field == "seed":  # the API's None is the flag left out
            bad = f"--seed must be an integer in [0, 2**63) (leave it out to draw one), got {args.seed}"
            raise ValueError(bad) from None
        raise ValueError(f"{_SAMPLING_FLAGS.get(field, field)} {rest}") from None
    if params.min_frames > params.max_frames:
        raise ValueError(f"{lengths['min'][1]} is more than {lengths['max'][1]}: no audio can be that long")
    return params


def _frame_rate(model: str) -> float:
    """Audio frames per second of a checkpoint (its config.json; 25 on Higgs-Audio V3), read before the load."""
    from .api import _checkpoint_dir
    from .config import TalkerConfig

    return TalkerConfig.from_pretrained(_checkpoint_dir(model)).frame_rate


def _demo(args) -> int:
    from .heads.sampling import SamplingParams

    _check_out(args.out)
    _check_wav_dir(args.wav_dir)
    talker = _load(args)
    texts = ["Hello from the Higgs talker.", "A second request, batched with the first.", "And a third one."]
    results = talker.generate(
        texts, [SamplingParams(seed=i, temperature=0.9) for i in range(len(texts))], max_frames=250
    )
    for r in results:
        print(f"[{r.request_id}] {r.text!r}: {r.summary()}")
    results[0].save(args.out)
    print(f"wrote {_shown(args.out)} ({results[0].num_frames} frames x {results[0].codes.shape[1]} codebooks)")
    if results[0].audio is not None:
        for i, r in enumerate(results):
            path = r.save(args.wav_dir / f"higgs_demo_{i}.wav")
            print(f"wrote {_shown(path)} ({r.audio_seconds:.2f} s at {r.sample_rate} Hz)")
    return 0


def _warmup(args) -> int:
    from .bytecode import import_start_modules, write_bytecode
    from .kernel_cache import use_cache_dir, warmup

    if args.cache_dir is not None:
        use_cache_dir(args.cache_dir)
    options = {} if args.max_model_len is None else {"max_model_len": args.max_model_len}
    report = warmup(args.model, args.device, args.dtype, graph_mode=args.graph_mode, **options)
    print("\n".join(report.lines()))
    import_start_modules()
    directory, written = write_bytecode()
    if written:
        print(f"bytecode: {written} modules in {directory} (read by higgs-talker where the interpreter keeps none)")
    return 0


def _serve(args) -> int:
    from .serve.options import run

    return run(args)


def _deploy_config(args) -> int:
    from .vllm_plugin.deploy import deploy_config_path

    print(deploy_config_path(args.profile))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0, 2 after a one-line error on stderr, 130 after Ctrl-C)."""
    restore = _interrupt_once()  # first: Ctrl-C while the parser or torch is still importing is one line too
    use_bytecode()  # before torch: on an image that ships no bytecode, what ``warmup`` compiled
    try:
        return _run(argv)
    except KeyboardInterrupt:  # the API has cancelled the requests and let the engine's thread finish its step
        print("higgs-talker: interrupted", file=sys.stderr)
        return 130
    finally:
        restore()


def command() -> None:
    """The ``higgs-talker`` command (and ``python -m higgs_talker``): ``main``, then exit with its status. Once
    ``main`` has returned, Ctrl-C is ignored: the interpreter's last second of teardown has nothing left to stop,
    and a Ctrl-C there would turn a finished run into a silent 130."""
    status = main()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)


def _run(argv: list[str] | None) -> int:
    try:
        args = _build_parser().parse_args(argv)
    except _UsageError as exc:
        return _fail(exc)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    handlers = {"generate": _generate, "demo": _demo, "warmup": _warmup, "deploy-config": _deploy_config}
    handlers["serve"] = _serve
    try:
        return handlers[args.command](args)
    except (ValueError, TypeError, OSError) as exc:  # OSError: unreadable / unwritable paths, missing files
        return _fail(exc)
    except RuntimeError as exc:
        if not _is_out_of_memory(exc):
            raise  # a bug: keep the traceback
        return _fail(f"out of memory: {exc} (a smaller model, or fewer / shorter sequences, needs less)")


def _interrupt_once():
    """Make the first Ctrl-C raise KeyboardInterrupt and ignore any later one, so the clean-up it starts
    (cancel, wait for the engine's step, remove a half-written file) is not cut short. Returns the undo.

    A Ctrl-C during an import is raised once the import is over: raised inside one, it can be swallowed by the C
    code running it (torch's numpy probe), so the command ran on to the end, or leave a module half-initialised,
    so it failed later with an unrelated traceback. The signal is sent again every 50 ms until then."""
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if previous in (None, signal.SIG_IGN):  # not the main thread (no signals there), or Ctrl-C is ignored
        return lambda: None
    retry: list[threading.Timer] = []

    def interrupt(signum, frame):
        if _importing(frame):
            retry[:] = [threading.Timer(0.05, os.kill, (os.getpid(), signum))]
            retry[0].daemon = True
            retry[0].start()
            return
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    def restore():
        for timer in retry:
            timer.cancel()
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, interrupt)
    return restore


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside an import (the import machinery is somewhere below it)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _is_out_of_memory(exc: RuntimeError) -> bool:
    """An allocation the machine could not satisfy (torch's CUDA OOM, or the CPU allocator's refusal)."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def _fail(exc: BaseException | str) -> int:
    message = str(exc).replace("\r", " ").replace("\n", " ") or type(exc).__name__  # one line, spaces as given
    print(f"higgs-talker: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
