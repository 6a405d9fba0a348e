"""``higgs-talker serve``'s flags and what it runs. Importing this module imports no server library: the CLI
builds its parser with it whether or not the ``serve`` extra is installed."""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

from ..splitting import DEFAULT_PART_CHARS

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="tiny", metavar="MODEL", help="checkpoint directory, or 'tiny'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--graph-mode", default=None, metavar="MODE", help="eager, local_mlp, full_decode or auto (CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=64, metavar="N", help="requests decoded together (default 64)")
    p.add_argument("--max-model-len", type=int, metavar="N", help="longest sequence (default: the checkpoint's)")
    p.add_argument("--prefix-caching", action="store_true", help="share the K/V of prompts that start alike (voices)")
    p.add_argument("--served-model-name", metavar="NAME", help="the name 'model' must give (default: MODEL's name)")
    p.add_argument(
        "--chunking",
        choices=("exact", "upstream", "fast-start"),
        default="exact",
        help="streamed audio: exact (equal to one-shot audio; first audio after 11 frames), upstream (vllm-omni's "
        "cuts: first audio after 5 frames, not exact) or fast-start (the first 3 frames at once, not exact; then "
        "exact)",
    )
    p.add_argument("--max-input-chars", type=int, default=20_000, metavar="N", help="longest input (default 20000)")
    p.add_argument(
        "--part-chars",
        type=int,
        default=DEFAULT_PART_CHARS,
        metavar="N",
        help=f"long input is spoken in parts of at most N characters, each capped from its text (default "
        f"{DEFAULT_PART_CHARS}); 0: one prompt of any length, as vllm-omni's endpoint",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="largest max_new_tokens a request may ask for, in audio frames (default 2048 = 82 s)",
    )
    p.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB", help="largest request body (default 16)")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="cancel a request still running after S seconds (default 600)",
    )
    p.add_argument("--max-voices", type=int, default=64, metavar="N", help="most uploaded voices kept (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling of requests that give none (default 1.0)")
    p.add_argument("--top-p", type=float, default=0.95, help="... their top_p (default 0.95, the deploy profiles')")
    p.add_argument("--top-k", type=int, default=50, help="... their top_k (default 50; -1: off)")


def run(args: argparse.Namespace) -> int:
    """Load the model, then serve until Ctrl-C or SIGTERM; returns the exit status."""
    install = "pip install -e '.[serve]' in the higgs_talker checkout"  # the package is not on PyPI
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"the server needs the 'serve' extra ({exc.name} is missing): {install}") from None
    try:  # voice uploads (multipart forms): FastAPI refuses to build the app without it, after the model loaded
        import python_multipart  # noqa: F401
    except ImportError:
        try:
            import multipart.multipart  # noqa: F401  (python-multipart before 0.0.13)
        except ImportError:
            raise ValueError(f"the server needs the 'serve' extra (python-multipart is missing): {install}") from None
    import torch

    from ..api import HiggsTalker
    from .app import make_server
    from .serving import SpeechServing

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must lie in [0, 65535], got {args.port}")
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):
        raise ValueError(f"--max-body-mb must be a number > 0, got {args.max_body_mb}")
    try:
        config = _config(args)
    except ValueError as exc:  # named by its flag, not by ServeConfig's field
        field, _, rest = str(exc).partition(" ")
        raise ValueError(f"{FLAGS.get(field, field)} {rest}") from None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    options = {"max_num_seqs": args.max_num_seqs, "prefix_caching": args.prefix_caching}
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    talker = HiggsTalker.from_pretrained(
        args.model, device=device, dtype=args.dtype, graph_mode=args.graph_mode, **options
    )
    serving = SpeechServing(talker, config)
    talker.codec  # noqa: B018 - load the decoder now, not during the first request
    server, sock = make_server(serving, args.host, args.port, "debug" if args.verbose else "info")
    host, port = sock.getsockname()[:2]
    print(
        f"higgs-talker: serving {config.model_name!r} on {device} at http://{host}:{port} (POST /v1/audio/speech)",
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down for
        pass
    finally:
        sock.close()
    print("higgs-talker: server stopped", flush=True)
    return 0


# ServeConfig's fields -> the flags that set them (its errors name the field first)
FLAGS = {"model_name": "--served-model-name", "max_input_chars": "--max-input-chars", "max_body_bytes": "--max-body-mb",
         "request_timeout_s": "--request-timeout", "max_new_tokens": "--max-new-tokens", "part_chars": "--part-chars",
         "chunking": "--chunking", "max_voices": "--max-voices", "temperature": "--temperature", "top_p": "--top-p",
         "top_k": "--top-k"}  # fmt: skip


def _config(args: argparse.Namespace):
    """The ``ServeConfig`` of the flags (ValueError naming a field whose value it refuses)."""
    from .serving import ServeConfig

    # the directory's own name however the path is written ("." included), "model" for the root directory
    default_name = "tiny" if args.model == "tiny" else Path(args.model).resolve().name or "model"
    return ServeConfig(
        model_name=args.served_model_name or default_name,
        max_input_chars=args.max_input_chars,
        max_body_bytes=int(args.max_body_mb * 2**20),
        request_timeout_s=args.request_timeout,
        max_new_tokens=args.max_new_tokens,
        part_chars=args.part_chars,
        chunking=args.chunking,
        max_voices=args.max_voices,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )
