"""CPU probe: the host time of the vLLM adapter's own Python per decode step, inside plain ``vllm.LLM`` (the
text-only bridge), on the tiny checkpoint (float32, enforce_eager, the engine core in this process). Each adapter
and bridge entry point is wrapped with a perf_counter timer; the table gives calls and microseconds per step
beside the whole step (wall / steps). On CPU the model's compute is inside ``forward`` and ``compute_logits``;
the other entry points are Python and small tensor ops, about what they cost the host on a GPU too. Prints;
asserts nothing.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/probes/plugin_host_time.py [REQUESTS] [TOKENS]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "vllm_plugin"))

SPENT: dict[str, list[float]] = defaultdict(list)


def timed(cls, name: str) -> None:
    fn = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[f"{cls.__name__}.{name}"].append(time.perf_counter() - t0)

    setattr(cls, name, wrapper)


def main(n_requests: int = 4, tokens: int = 200) -> None:
    import vllm
    from serve_tiny import build_requests

    from higgs_talker.config import TalkerConfig
    from higgs_talker.prompt import TalkerTokenizer
    from higgs_talker.tiny import tiny_checkpoint
    from higgs_talker.vllm_plugin import TEXT_ONLY_BRIDGE
    from higgs_talker.vllm_plugin.bridge import ROWS_EXTENSION, TextOnlyBridge
    from higgs_talker.vllm_plugin.talker import HiggsTalkerForConditionalGeneration as Talker

    for name in ("forward", "compute_logits", "sample", "set_bridge_requests", "embed_input_ids"):
        if hasattr(Talker, name):
            timed(Talker, name)
    for name in ("update_state", "apply"):
        timed(TextOnlyBridge, name)
    from vllm.model_executor.models.qwen3 import Qwen3Model

    timed(Qwen3Model, "forward")  # the backbone's compute inside the adapter's forward
    ckpt = str(tiny_checkpoint())
    cfg = TalkerConfig.from_pretrained(ckpt)
    tok = TalkerTokenizer.from_pretrained(ckpt, cfg)
    llm = vllm.LLM(model=ckpt, max_num_batched_tokens=max(512, 64 * n_requests), logits_processors=[TEXT_ONLY_BRIDGE],
                   worker_extension_cls=ROWS_EXTENSION, enforce_eager=True, dtype="float32", max_model_len=1024,
                   max_num_seqs=max(8, n_requests))  # fmt: skip
    spec = [{"key": f"r{i}", "text": f"Request number {i} of the probe.", "max_tokens": tokens, "temperature": 1.0,
             "top_k": 50, "top_p": 0.95, "seed": i} for i in range(n_requests)]  # fmt: skip
    prompts, params = build_requests(tok, cfg, spec)
    for p in params:
        p.min_tokens = tokens
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm up
    SPENT.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = len(SPENT.get("HiggsTalkerForConditionalGeneration.forward", [])) or 1
    print(f"{n_requests} requests x {tokens} tokens: {steps} forward calls, {wall / steps * 1e6:.0f} us a step (wall)")
    print(f"{'entry point':55s} {'calls':>6s} {'us/step':>9s} {'us/call':>9s}")
    for name, spent in sorted(SPENT.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:55s} {len(spent):6d} {sum(spent) / steps * 1e6:9.0f} {sum(spent) / len(spent) * 1e6:9.0f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("requests", nargs="?", type=int, default=4, help="requests stepped together (default 4)")
    p.add_argument("tokens", nargs="?", type=int, default=200, help="tokens (= rows) per request (default 200)")
    args = p.parse_args()
    if importlib.util.find_spec("vllm") is None:
        sys.exit(f"{Path(__file__).name} runs inside vllm.LLM: vllm is not installed here (pip install -e '.[vllm]')")
    main(args.requests, args.tokens)
