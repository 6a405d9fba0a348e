"""Serve the tiny checkpoint with plain ``vllm.LLM`` through the higgs_talker plugin; print codes as JSON.

Run as a script (the CPU backend spawns workers):
``python serve_tiny.py CKPT_DIR SPEC_JSON [MAX_BATCHED [LLM_KWARGS_JSON]]``. SPEC_JSON is a list of requests
``{"key", "text", "temperature", "top_k", "top_p", "seed", "max_tokens"}`` (optional: ``reference`` ``{"seed",
"frames", "text"}`` makes it a voice clone; ``wave``, 0 by default: the requests of wave n + 1 start once those
of wave n have finished, so that they can hit their prefix-cache blocks); LLM_KWARGS_JSON overrides the
``vllm.LLM`` arguments (the GPU suite: dtype, attention backend, graph mode).
Prints one JSON line ``{"results": [...], "arch_class": ..., "loaded": ...}`` prefixed with ``RESULT:``; each
result carries vLLM's ``num_cached_tokens`` (the prompt tokens its prefix cache supplied).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).with_name("score_probe")))
from higgs_score_probe import as_record, record_scores  # noqa: E402


def reference_codes(spec: dict, cfg):
    """The voice-clone reference codes [F, C] of a spec request for checkpoint config ``cfg`` (random real codes
    from its ``reference`` seed), or None: the one draw both this script and the tests that rebuild its requests
    use (on the tiny checkpoint, [F, 8] in [0, 1024))."""
    import torch

    ref = spec.get("reference")
    if ref is None:
        return None
    shape, gen = (ref["frames"], cfg.num_codebooks), torch.Generator().manual_seed(ref["seed"])
    return torch.randint(0, cfg.num_real_codes, shape, generator=gen)


def build_requests(tok, cfg, spec: list[dict]) -> tuple[list[dict], list]:
    """vLLM prompts and sampling parameters for the spec's requests (a voice clone: random reference codes
    from its seed, as the tests rebuild them; its prompt carries the rows' ``cache_salt``)."""
    import vllm

    from higgs_talker.vllm_plugin.bridge import request_args

    prompts, params = [], []
    for r in spec:
        codes = reference_codes(r, cfg)
        ref_text = None if codes is None else r["reference"].get("text")
        prompt = tok.build(r["text"], codes, ref_text, cfg)
        prompts.append(prompt.vllm_prompt())
        params.append(
            vllm.SamplingParams(
                temperature=r.get("temperature", 0.0),
                top_k=r.get("top_k", -1),
                top_p=r.get("top_p", 1.0),
                seed=r.get("seed"),
                max_tokens=r["max_tokens"],
                detokenize=False,
                extra_args=request_args(r["key"], prompt),
            )
        )
    return prompts, params


def in_process(adapter):
    if adapter is None:
        raise RuntimeError(
            "HIGGS_RECORD_SCORES needs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); for worker "
            "processes put score_probe/ on PYTHONPATH and set HIGGS_SCORE_PROBE_DIR"
        )
    return adapter


def main(ckpt: str, spec: list[dict], max_num_batched_tokens: int = 512, llm_kwargs: dict | None = None) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model lives in this process
    import vllm

    from higgs_talker.config import TalkerConfig
    from higgs_talker.prompt import TalkerTokenizer
    from higgs_talker.vllm_plugin import TEXT_ONLY_BRIDGE
    from higgs_talker.vllm_plugin.bridge import ROWS_EXTENSION, request_rows
    from higgs_talker.vllm_plugin.talker import talker_for

    cfg = TalkerConfig.from_pretrained(ckpt)
    tok = TalkerTokenizer.from_pretrained(ckpt, cfg)
    kwargs = dict(enforce_eager=True, dtype="float32", max_model_len=512, max_num_seqs=8)
    llm = vllm.LLM(
        model=ckpt,
        max_num_batched_tokens=max_num_batched_tokens,
        logits_processors=[TEXT_ONLY_BRIDGE],
        worker_extension_cls=ROWS_EXTENSION,  # rows and reports by method name from worker processes too
        **(kwargs | (llm_kwargs or {})),
    )
    prompts, params = build_requests(tok, cfg, spec)
    scores_path = os.environ.get("HIGGS_RECORD_SCORES")  # the engine in this process (workers: score_probe/)
    adapter = in_process(talker_for(llm.llm_engine.vllm_config)) if scores_path else None
    recorded = record_scores(adapter) if adapter is not None else None
    outputs: list = [None] * len(spec)
    for wave in sorted({r.get("wave", 0) for r in spec}):
        batch = [i for i, r in enumerate(spec) if r.get("wave", 0) == wave]
        done = llm.generate([prompts[i] for i in batch], [params[i] for i in batch], use_tqdm=False)
        for i, out in zip(batch, done, strict=True):
            outputs[i] = out
    if recorded is not None:
        import torch

        adapter.slots.settle()  # the last step's rows reach the records when something reads them
        torch.save({key: as_record(key, steps)["scaled"] for key, steps in recorded.items()}, scores_path)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":  # the adapter lives in this process: findable
        assert talker_for(llm.llm_engine.vllm_config) is not None, "no talker adapter for this engine's config"
    rows = request_rows(llm, [r["key"] for r in spec])  # from every worker (tensor parallel: they must agree)
    results = []
    for r, out in zip(spec, outputs, strict=True):
        got = rows[r["key"]]
        results.append(
            {
                "key": r["key"],
                "token_ids": list(out.outputs[0].token_ids),
                "finish_reason": out.outputs[0].finish_reason,
                "num_cached_tokens": out.num_cached_tokens,
                "rows": got.tolist() if got is not None else None,
            }
        )
    reports = llm.collective_rpc("higgs_adapter_report")  # one per worker; rank 0's is reported
    shut_down(llm)
    return {"results": results, "ranks": len(reports), **reports[0]}


def shut_down(llm) -> None:
    """Stop vLLM's engine processes now, giving them ``SERVE_TINY_SHUTDOWN_S`` (5 s by default) to end. Left to
    interpreter exit, vLLM's client SIGKILLs the engine process and its workers 5 s after asking them to stop, and a
    worker still tearing down then never runs its exit hooks (the step-timing probe's final write). With a longer
    timeout, set ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (the engine process's wait for its workers) below it."""
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":  # in-process engines end with the interpreter
        llm.llm_engine.engine_core.shutdown(timeout=float(os.environ.get("SERVE_TINY_SHUTDOWN_S", "5")))


if __name__ == "__main__":
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    out = main(sys.argv[1], json.loads(sys.argv[2]), *(int(a) for a in sys.argv[3:4]), llm_kwargs=extra)
    print("RESULT:" + json.dumps(out))
