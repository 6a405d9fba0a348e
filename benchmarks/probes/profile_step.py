"""Where a decode step's time goes: cProfile of the host side and torch.profiler's CUDA kernel table.

CUDA only (not part of the CPU smoke tests). 4B shape, random bf16 weights, 512-token prompts:
``full_decode`` at batch 1 and 64, ``local_mlp`` at batch 64 and 1; plus an XQA probe (block-table width and
``max_seq_len`` vs time, native beside it). The H200 output of 2026-11-30 (taken on the commit before the
decode host-path change) is ``benchmarks/results/h200_20261130/profile_prev_commit.log``.

    python benchmarks/probes/profile_step.py [xqa] [full] [local] [xqa_step] [fused] [cublasrows]

``fused`` builds the engines of ``full``/``local`` with ``fuse_qk_rope=True``; ``cublasrows`` with
``row_gemv="off"`` (cuBLAS for one-row linears too; default: the library's ``"auto"``).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode import SHAPE_4B, make_prompt, suppress_eoc  # noqa: E402

from higgs_talker import HiggsTalker, SamplingParams, TalkerConfig, TextConfig  # noqa: E402
from higgs_talker.cuda_graphs.capture import capture_graph, median_ms  # noqa: E402


def _time_graph(fn) -> float:
    """Median microseconds of one ``fn()`` replayed from a CUDA graph (3 samples of 20 replays)."""
    graph, _ = capture_graph(fn)
    return median_ms(lambda: [graph.replay() for _ in range(20)], iters=3) * 1e3 / 20


def start_requests(talker: HiggsTalker, b: int, ctx: int) -> list[str]:
    eng = talker.engine
    params = SamplingParams(temperature=0.0, max_frames=400)
    ids = [eng.add_request(make_prompt(talker, ctx, seed=i), params) for i in range(b)]
    while any(not eng.requests[i].rows for i in ids):
        eng.step()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    return ids


def profile_case(talker: HiggsTalker, mode: str, b: int, ctx: int) -> None:
    ids = start_requests(talker, b, ctx)
    eng = talker.engine
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"=== {mode} b={b} ctx={ctx}: step median {times[5] * 1e3:.2f} ms", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
        print(s.getvalue()[-6000:])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kprof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    print(kprof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    for i in ids:
        eng.cancel(i)
        eng.requests.pop(i, None)


def xqa_probe() -> None:
    """XQA us per call in a CUDA graph vs block-table width / max_seq_len (8 caches per replay), native beside."""
    import flashinfer as fi

    dev, bs, hq, hk, d = "cuda", 16, 32, 8, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    ws_xqa = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    for b in (1, 4, 16, 64):
        for ctx in (256, 512, 2048):
            per = -(-ctx // bs)
            caches = [torch.randn(b * per + 1, 2, bs, hk, d, generator=gen, device=dev).bfloat16() for _ in range(8)]
            q = torch.randn(b, hq, d, generator=gen, device=dev).bfloat16()
            out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=dev)
            lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
            res = []
            for width, maxlen in ((per, ctx), (256, 4096), (256, ctx), (512, 8192), (2048, 32768)):
                table = torch.full((b, width), b * per, dtype=torch.int32, device=dev)
                table[:, :per] = torch.arange(b * per, dtype=torch.int32, device=dev).view(b, per)

                def xqa(table=table, maxlen=maxlen, caches=caches, q=q, out=out, lens=lens):
                    for c in caches:
                        fi.decode.trtllm_batch_decode_with_kv_cache(
                            q, c, ws_xqa, table, lens, maxlen, bmm1_scale=d**-0.5, bmm2_scale=1.0, out=out,
                            kv_layout="NHD", backend="xqa",
                        )  # fmt: skip

                try:
                    res.append(f"w{width}/m{maxlen}={_time_graph(xqa) / 8:.1f}")
                except Exception as exc:  # noqa: BLE001 - record and go on
                    res.append(f"w{width}/m{maxlen}=ERR {type(exc).__name__}")
            w = fi.BatchDecodeWithPagedKVCacheWrapper(
                ws,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(b * 2048, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32, device=dev),
            )
            w.plan(
                torch.arange(0, b * per + 1, per, dtype=torch.int32),
                torch.arange(b * per, dtype=torch.int32),
                torch.full((b,), ctx - (per - 1) * bs, dtype=torch.int32),
                hq, hk, d, bs, pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                sm_scale=d**-0.5,
            )  # fmt: skip

            def native(w=w, caches=caches, q=q, out=out):
                for c in caches:
                    w.run(q, c, out=out)

            res.append(f"native={_time_graph(native) / 8:.1f}")
            print(f"xqa b={b} ctx={ctx}: " + " ".join(res), flush=True)
            del caches


def layer_sandwich(talker: HiggsTalker, b: int) -> str:
    """Per layer, in CUDA graphs on the engine's own caches and bucket-``b`` tables (set by the last step): 36 XQA
    calls alone; qkv + o_proj GEMMs; the GEMMs with XQA between them; the GEMMs with a one-element add between
    them (what any kernel costs there)."""
    import flashinfer as fi

    attn, t = talker.engine.runner.attn, talker.cfg.text
    layers = list(talker.model.model.layers)
    tables, lens = attn.block_tables[:b], attn.seq_lens[:b]  # bucket b's rows of the fixed decode buffers
    gen = torch.Generator(device="cuda").manual_seed(b)
    q = torch.randn(b, t.num_attention_heads, t.head_dim, generator=gen, device="cuda").bfloat16()
    x = torch.randn(b, t.hidden_size, generator=gen, device="cuda").bfloat16()
    one = torch.zeros(1, device="cuda")

    def xqa(layer: int) -> torch.Tensor:
        return fi.decode.trtllm_batch_decode_with_kv_cache(
            q, attn.kv_caches[layer], attn.xqa_workspace, tables, lens, attn.max_model_len,
            bmm1_scale=attn.scale, bmm2_scale=1.0, kv_layout="NHD", backend="xqa",
        )  # fmt: skip

    def run(between: str) -> None:
        for i, layer in enumerate(layers):
            layer.self_attn.qkv_proj(x)
            out = q
            if between == "xqa":
                out = xqa(i)
            elif between == "add":
                one.add_(1.0)
            layer.self_attn.o_proj(out.reshape(b, -1))

    n = len(layers)
    alone = _time_graph(lambda: [xqa(i) for i in range(n)]) / n
    g, c, d = (_time_graph(lambda k=k: run(k)) / n for k in ("none", "xqa", "add"))
    return (
        f"XQA alone {alone:.1f} us; GEMMs {g:.1f}; GEMMs+XQA {c:.1f} (+{c - g:.1f}); GEMMs+add {d:.1f} (+{d - g:.1f})"
    )


def xqa_in_step_probe(cfg: TalkerConfig) -> None:
    """Why XQA is slower inside a decode step than alone: ``layer_sandwich`` after real decode steps at batch
    1/16/64 (XQA forced, 512-token prompts). (GEMMs+XQA - GEMMs) is XQA's time between the GEMMs of a step.
    ``h200_20261130/xqa_in_step.log`` was written before the sandwich gained its one-element-add variant."""
    talker = HiggsTalker.from_config(
        cfg, device="cuda", dtype="bfloat16", graph_mode="full_decode", decode_kernel="xqa", max_num_seqs=64,
        num_blocks=64 * 40 + 64, max_model_len=4096,
    )  # fmt: skip
    suppress_eoc(talker)
    for b in (1, 16, 64):
        ids = start_requests(talker, b, 512)
        ctx = talker.engine.runner.attn.seq_lens[0].item()
        print(f"xqa-in-step b={b} ctx~{ctx}: {layer_sandwich(talker, b)}", flush=True)
        for i in ids:
            talker.engine.cancel(i)
            talker.engine.requests.pop(i, None)
    del talker
    torch.cuda.empty_cache()


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe (FlashInfer, CUDA graphs): no CUDA device here")
    what = sys.argv[1:] or ["xqa", "full", "local"]
    torch.set_grad_enabled(False)
    if "xqa" in what:
        xqa_probe()
    cfg = TalkerConfig(text=TextConfig(**SHAPE_4B))
    if "xqa_step" in what:
        xqa_in_step_probe(cfg)
    for mode, cases in (("full_decode", [(1, 512), (64, 512)]), ("local_mlp", [(64, 512), (1, 512)])):
        if mode.split("_")[0] not in what:
            continue
        t0 = time.perf_counter()
        talker = HiggsTalker.from_config(
            cfg,
            device="cuda",
            dtype="bfloat16",
            graph_mode=mode,
            max_num_seqs=64,
            num_blocks=64 * 40 + 64,
            max_model_len=4096,
            fuse_qk_rope="fused" in what,
            row_gemv="off" if "cublasrows" in what else "auto",
        )
        suppress_eoc(talker)
        kernels = talker.model.kernels
        print(f"built {mode} (fuse_qk_rope={kernels.fuse_qk_rope}, row_gemv={kernels.row_gemv}: "
              f"{dict(kernels.row_configs)}, few rows {dict(kernels.few_row_configs)}) in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
        for b, ctx in cases:
            profile_case(talker, mode, b, ctx)
        del talker
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
