"""Serve the tiny checkpoint with vLLM's ``AsyncLLM`` (what ``vllm serve`` runs) over data-parallel engines
through the higgs_talker plugin; print codes and each engine's adapter report as JSON.

Run as a script (the engines are processes): ``python serve_tiny_dp.py CKPT_DIR SPEC_JSON DP_SIZE
[ENGINE_KWARGS_JSON]``, SPEC_JSON as for ``serve_tiny.py``; ENGINE_KWARGS_JSON overrides the engine arguments
(on GPUs, e.g. ``{"dtype": "bfloat16", "enforce_eager": false}``). Prints one line ``RESULT:{"results": [...],
"engines": [...], "ranks": ..., **engine 0's report}``, as ``serve_tiny.py`` prints, plus each engine's counters.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


async def serve(ckpt: str, spec: list[dict], dp: int, engine_kwargs: dict | None = None) -> dict:
    from serve_tiny import build_requests
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from higgs_talker.config import TalkerConfig
    from higgs_talker.prompt import TalkerTokenizer
    from higgs_talker.vllm_plugin import TEXT_ONLY_BRIDGE
    from higgs_talker.vllm_plugin.bridge import ROWS_EXTENSION, request_rows_async
    from higgs_talker.vllm_plugin.compat import collective_rpc_every_engine

    cfg = TalkerConfig.from_pretrained(ckpt)
    tok = TalkerTokenizer.from_pretrained(ckpt, cfg)
    kwargs = dict(enforce_eager=True, dtype="float32", max_model_len=512, max_num_seqs=8) | (engine_kwargs or {})
    args = AsyncEngineArgs(model=ckpt, logits_processors=[TEXT_ONLY_BRIDGE], worker_extension_cls=ROWS_EXTENSION,
                           data_parallel_size=dp, **kwargs)  # fmt: skip
    engine = AsyncLLM.from_engine_args(args)
    try:

        async def one(key: str, prompt: dict, params):
            last = None
            async for out in engine.generate(prompt, params, key):
                last = out
            return last.outputs[0]

        prompts, params = build_requests(tok, cfg, spec)
        outputs = await asyncio.gather(*(one(r["key"], p, sp) for r, p, sp in zip(spec, prompts, params, strict=True)))
        rows = await request_rows_async(engine, [r["key"] for r in spec])
        reports = await collective_rpc_every_engine(engine, "higgs_adapter_report")  # per engine, per worker
    finally:
        engine.shutdown()
    results = [{"key": r["key"], "tokens": len(o.token_ids), "token_ids": list(o.token_ids),
                "finish_reason": o.finish_reason, "rows": None if rows[r["key"]] is None else rows[r["key"]].tolist()}
               for r, o in zip(spec, outputs, strict=True)]  # fmt: skip
    return {"results": results, "engines": [{"stats": rep[0]["stats"]} for rep in reports], "ranks": len(reports[0]),
            **reports[0][0]}  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    out = asyncio.run(serve(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), extra))
    print("RESULT:" + json.dumps(out), flush=True)
