"""``higgs-talker``: generate codes from the command line, run the demo, print deploy profiles.

Paths given on the command line are only opened as files or directories; nothing is executed or evaluated.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="higgs-talker", description="Higgs-Audio V3 talker: text -> codec codes")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate codes for a text")
    g.add_argument("text")
    _add_model_args(g)
    g.add_argument("--out", type=Path, help="write audio to .wav (24 kHz mono 16-bit), or codes to .npy / .safetensors")
    g.add_argument("--seed", type=int)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-frames", type=int, default=2048)
    g.add_argument("--min-frames", type=int, default=0, help="no end of stream (EOC) before this many frames")
    g.add_argument("--reference", type=Path, help="reference voice: WAV audio (1-30 s) or aligned codes [T, 8] (.npy)")
    g.add_argument("--reference-text", help="transcript of the reference audio")
    g.add_argument("--audio-tokenizer", type=Path, help="audio tokenizer directory that encodes --reference audio")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")

    d = sub.add_parser("demo", help="run the embedded tiny checkpoint end to end")
    _add_model_args(d)
    d.add_argument("--out", type=Path, default=Path("higgs_demo_codes.npy"))
    d.add_argument("--wav-dir", type=Path, default=Path("."), help="where higgs_demo_<i>.wav are written")

    c = sub.add_parser("deploy-config", help="print the path of a vLLM deploy profile")
    c.add_argument("profile", help="high-throughput, low-latency or default")
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny' (default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--graph-mode", default=None, help="eager, local_mlp, full_decode or auto (CUDA only)")


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
    """A one-line progress bar on stderr (rows generated so far)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.start = total, enabled and sys.stderr.isatty(), time.perf_counter()

    def __call__(self, rows: int) -> None:
        if not self.enabled:
            return
        width = 30
        filled = min(width, int(width * rows / max(self.total, 1)))
        rate = rows / max(time.perf_counter() - self.start, 1e-9)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {rows} rows, {rate:.0f} rows/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _generate(args) -> int:
    from .api import Reference
    from .heads.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_frames=args.max_frames,
        min_frames=args.min_frames,
    )
    if args.out is not None and args.out.suffix not in (".wav", ".npy", ".safetensors"):
        raise ValueError(f"--out {str(args.out)!r}: unknown format {args.out.suffix!r}; use .wav, .npy or .safetensors")
    reference = None
    if args.reference is not None:
        if args.reference.suffix == ".npy":
            reference = Reference(np.load(args.reference, allow_pickle=False), args.reference_text)
        else:  # audio: encoded by the codec when the prompt is built
            reference = Reference(audio=args.reference, text=args.reference_text)
    elif args.reference_text is not None:
        raise ValueError("--reference-text needs --reference")
    talker = _load(args)
    progress = _Progress(params.max_frames, not args.no_progress)
    try:
        result = talker.generate(args.text, params, reference=reference, progress=progress)
    finally:
        progress.close()
    if args.out is not None:
        result.save(args.out)
        print(f"wrote {args.out}")
    print(result.summary())
    return 0


def _demo(args) -> int:
    from .heads.sampling import SamplingParams

    talker = _load(args)
    texts = ["Hello from the Higgs talker.", "A second request, batched with the first.", "And a third one."]
    results = talker.generate(
        texts, [SamplingParams(seed=i, temperature=0.9) for i in range(len(texts))], max_frames=250
    )
    for r in results:
        print(f"[{r.request_id}] {r.text!r}: {r.summary()}")
    results[0].save(args.out)
    print(f"wrote {args.out} ({results[0].num_frames} frames x {results[0].codes.shape[1]} codebooks)")
    if results[0].audio is not None:
        args.wav_dir.mkdir(parents=True, exist_ok=True)
        for i, r in enumerate(results):
            path = r.save(args.wav_dir / f"higgs_demo_{i}.wav")
            print(f"wrote {path} ({r.audio_seconds:.2f} s at {r.sample_rate} Hz)")
    return 0


def _deploy_config(args) -> int:
    from .vllm_plugin.deploy import deploy_config_path

    print(deploy_config_path(args.profile))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    handlers = {"generate": _generate, "demo": _demo, "deploy-config": _deploy_config}
    try:
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"higgs-talker: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
