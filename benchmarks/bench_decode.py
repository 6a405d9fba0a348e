"""Decode-step time per graph mode x batch x context, against the HBM floor and transformers in the same run.

For each graph mode the talker is built once through the public API (``HiggsTalker.from_config``: the 4B shape
with random bf16 weights by default; ``--model DIR`` loads a checkpoint), then for each (context, batch):
B requests whose prompts are ``context`` tokens long are added (``max_frames`` far away), stepped until every
one is decoding, warmed up, and ``talker.engine.step()`` is timed with CUDA events, one step at a time (median
over ``--steps`` steps; steps where a request dropped out are excluded).

Each point is timed once per ``--sampling`` name (default ``deploy,greedy``, the same built talker, rows
labelled ``sampling``): ``deploy`` is the deploy profiles' sampling (temperature 1.0, top_p 0.95, top_k 50,
seeded requests), the headline; ``greedy`` is the argmax. They replay different full-decode graphs: a batch
with top-k / top-p on takes the whole sampler (noise, sort and filter), an all-greedy batch the argmax-only
variant (``cuda_graphs.full_decode``); the rows record which (``sampler_draw``, ``sampler_filter``), and what
each of the frame's Triton kernels did (``frame_kernels``: ok, off after a failed first-use check, disabled, untried).

The floor is the bytes one decode step must read over the device-to-device copy bandwidth measured at the
start of the run: every layer's weights + the final norm + the codebook table (the text embedding is only
gathered, the text head is never read in audio decode) + the KV cache (batch x context x layers x 2 x
kv_heads x head_dim x element size).

Peers (``--no-peers`` to skip): transformers ``Qwen3ForCausalLM`` with the same shape and weights (ours copied
in; its head is the codebook table), eager with its dynamic cache and with ``StaticCache`` +
``torch.compile(mode="reduce-overhead")``. They take the argmax of the last position's logits (the codebook table
as the vocabulary, no sampling, no delay pattern): their rows are labelled ``greedy`` and compare with ours at
``greedy``.

``--fuse both`` times every mode twice, as ``MODE-fused`` (the library's default, ``fuse_qk_rope=True``: QK-norm,
RoPE and the K/V writes in one Triton kernel) and ``MODE`` (``fuse_qk_rope=False``: the separate kernels), in
the same run; ``--fuse on`` (the default) times the first only, ``off`` the second. Likewise ``--async both`` adds
``...-sync`` rows (``async_scheduling=False``: each step's rows read before the next step is queued), and
``--decode-kernels native,xqa,native_tc,...`` pins the decode attention kernel (``...+KERNEL`` rows) instead of the
per-bucket measurement (``auto``), and ``--head-kernels both`` adds ``...-torchhead`` rows (the frame's noise hash,
delay mask and state update as torch operations instead of the Triton kernels that are the CUDA default,
``heads.fused``; graphs capture whichever the variant uses), ``--race-kernel both`` adds ``...-torchrace`` rows (the
sampled step's filter, noise and race as torch operations around the noise kernel instead of the one Triton kernel
that is the CUDA default); ``--sampler-
variants both`` adds ``...-wholesampler`` rows (full-decode graphs without the cheaper greedy / no-filter sampler
variants); ``--row-gemv auto,off`` times each mode with the one-row Triton GEMV measured per linear (``auto``, the
default) and with cuBLAS for every linear (``...-cublasrows`` rows; ``on``: the GEMV on every linear,
``...-rowgemv``).

With random weights the codebook-0 EOC row of the table is zeroed, so no request ends early: its logit is
exactly 0 while the max of 1024 random logits is positive (greedy), and about half of them are positive, so
top_k 50 never keeps it (deploy); ``meta.eoc_suppressed`` says so.

    python benchmarks/bench_decode.py --out $OUT                       # 4B shape, all modes, deploy and greedy
    python benchmarks/bench_decode.py --modes auto --sampling deploy --no-peers   # the headline sampling only
    python benchmarks/bench_decode.py --modes eager,auto --batches 1,64 --contexts 512 --no-peers
    python benchmarks/bench_decode.py --modes full_decode --batches 1,64 --contexts 512 --fuse both --no-peers
    python benchmarks/bench_decode.py --modes full_decode --batches 1,64 --contexts 512 --async both --no-peers
    python benchmarks/bench_decode.py --device cpu --tiny              # smoke test, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import random
import string
import time
from collections.abc import Sequence

import torch
from common import (
    SAMPLINGS,
    ResultFile,
    StepTimer,
    add_sampling_option,
    copy_bandwidth,
    environment,
    error_text,
    free_memory,
    ints_arg,
    log,
    median,
    percentile,
    print_table,
    resolve_device,
    strs_arg,
    sync,
)

from higgs_talker import HiggsTalker, SamplingParams, TalkerConfig, TextConfig, flashinfer_attention, pdl
from higgs_talker.cuda_graphs import PREFILL_BUCKETS
from higgs_talker.cuda_graphs import full_decode as full_graphs
from higgs_talker.flashinfer_attention import KERNELS
from higgs_talker.heads import fused
from higgs_talker.tiny import tiny_config

DEFAULT_SAMPLER_VARIANTS = full_graphs.SAMPLER_VARIANTS
DEFAULT_PDL = pdl.ENABLED
DEFAULT_TRITON_QKV = flashinfer_attention.TRITON_TAKES_QKV


def _triton_gemv():
    """``higgs_talker.triton_gemv``, or None where triton is not installed."""
    try:
        from higgs_talker import triton_gemv
    except ImportError:
        return None
    return triton_gemv


DEFAULT_FEW_ROW_CONFIGS = getattr(_triton_gemv(), "FEW_ROW_CONFIGS", ())
DEFAULT_DISABLED = frozenset(fused.DISABLED)  # the frame kernels the library leaves off
FRAME_KERNELS = ("sampler noise", "sampler race", "delay mask", "delay state update")  # heads.fused's names

SHAPE_4B = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=32768,
)
MODES = ("eager", "local_mlp", "full_decode", "auto")
FUSED = "-fused"  # label suffix: the mode with fuse_qk_rope=True
SYNC = "-sync"  # label suffix: async_scheduling=False
UNPADDED = "-eagerprefill"  # label suffix: no prefill graphs (prefill_buckets=(): prefills run eagerly)
PREFIX_CACHE = "+pcache"  # label suffix: prefix caching on (prefix_caching=True)
TORCH_HEAD = "-torchhead"  # label suffix: heads.fused.ENABLED = False
TORCH_RACE = "-torchrace"  # label suffix: the race kernel off ("sampler race" in heads.fused.DISABLED)
WHOLE_SAMPLER = "-wholesampler"  # label suffix: no sampler variants (cuda_graphs.full_decode.SAMPLER_VARIANTS)
QKV_APART = "-qkvapart"  # label suffix: the triton decode kernel after the separate QK-norm/RoPE/K-V kernel
NO_PDL = "-nopdl"  # label suffix: our Triton kernels launched without programmatic dependent launch (pdl.ENABLED)
CUBLAS_FEW = "-cublasfew"  # label suffix: inputs of 2-16 rows stay on cuBLAS (no few-row tile tried)
ROW_GEMV_LABELS = {"auto": "", "off": "-cublasrows", "on": "-rowgemv"}  # label suffix per row_gemv option
DECODE_KERNELS = ("auto", *KERNELS)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One talker configuration to time; its label names what differs from the library's defaults."""

    mode: str
    fuse: bool = True
    async_scheduling: bool | None = True  # None: the library's default (on CUDA)
    kernel: str = "auto"
    prefill_graphs: bool = True  # prefill graphs (PREFILL_BUCKETS: the default in full_decode and auto)
    prefix_caching: bool = False  # share the K/V of common prompt prefixes (opt-in in the library)
    head_kernels: bool = True  # the frame's Triton kernels (heads.fused; the CUDA default)
    sampler_variants: bool = True  # full-decode graphs with the cheaper samplers (the default)
    race_kernel: bool = True  # a sampled step's filter, noise and race as one Triton kernel (the CUDA default)
    row_gemv: str = "auto"  # one-row inputs: the Triton GEMV where measured faster (auto), everywhere (on), nowhere
    triton_qkv: bool = True  # the triton decode kernel takes the qkv rows (QK-norm, RoPE, K/V write in its launch)
    pdl: bool = True  # our Triton GEMV and decode attention launch with PDL (on Hopper)
    few_rows: bool = True  # inputs of 2-16 rows may take the few-row Triton kernel (as row_gemv says)

    @property
    def prefill_label(self) -> str:
        """The label suffixes of the prefill options (prefill graphs, prefix caching) that differ from the defaults."""
        return ("" if self.prefill_graphs else UNPADDED) + (PREFIX_CACHE if self.prefix_caching else "")

    @property
    def label(self) -> str:
        kernel = "" if self.kernel == "auto" else f"+{self.kernel}"
        prefill = self.prefill_label
        sync = SYNC if self.async_scheduling is False else ""
        head = "" if self.head_kernels else TORCH_HEAD
        whole = "" if self.sampler_variants else WHOLE_SAMPLER
        race = TORCH_RACE if self.head_kernels and not self.race_kernel else ""
        rows = ROW_GEMV_LABELS[self.row_gemv]
        qkv = "" if self.triton_qkv else QKV_APART
        early = "" if self.pdl else NO_PDL
        few = "" if self.few_rows else CUBLAS_FEW
        return (f"{self.mode}{FUSED if self.fuse else ''}{kernel}{prefill}{sync}{head}{race}{whole}{rows}{qkv}{early}"
                f"{few}")  # fmt: skip


PEER_RESERVE_S = 100.0  # the time budget keeps this much for the transformers rows


# ---------------------------------------------------------------------------------------------------------
# model, prompts, floor


def model_config(args: argparse.Namespace) -> TalkerConfig:
    if args.model:
        return TalkerConfig.from_pretrained(args.model)
    if args.tiny:
        return tiny_config()
    return TalkerConfig(text=TextConfig(**SHAPE_4B))


def build_talker(args: argparse.Namespace, cfg: TalkerConfig, variant: Variant, num_blocks: int) -> HiggsTalker:
    common = dict(
        graph_mode=variant.mode, max_num_seqs=args.max_num_seqs, num_blocks=num_blocks, fuse_qk_rope=variant.fuse,
        decode_kernel=variant.kernel, async_scheduling=variant.async_scheduling,
        prefill_buckets=PREFILL_BUCKETS if variant.prefill_graphs else (), prefix_caching=variant.prefix_caching,
        row_gemv=variant.row_gemv,
    )  # fmt: skip
    if args.max_model_len:
        common["max_model_len"] = args.max_model_len
    if args.model:
        return HiggsTalker.from_pretrained(args.model, device=args.device, dtype=args.dtype, **common)
    return HiggsTalker.from_config(cfg, device=args.device, dtype=args.dtype, seed=args.seed, **common)


def suppress_eoc(talker: HiggsTalker) -> None:
    """Zero codebook 0's EOC row of the head so greedy decoding never stops (random weights only)."""
    with torch.no_grad():
        talker.model.modality_head.weight[talker.cfg.eoc_id].zero_()


def make_prompt(talker: HiggsTalker, tokens: int, seed: int):
    """A plain TTS prompt of exactly ``tokens`` tokens (random letters; resized until the count matches)."""
    rng = random.Random(seed)
    letters = string.ascii_lowercase
    n = max(1, tokens - 3)
    for _ in range(12):
        text = "".join(rng.choice(letters) for _ in range(n))
        prompt = talker.build_prompt(text)
        have = len(prompt)
        if have == tokens:
            return prompt
        n = max(1, n + (tokens - have) * max(1, round(n / max(have - 3, 1))))
    return prompt  # a real BPE tokenizer may not hit the count exactly; rows record the actual lengths


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes a decode step reads: all decoder layers, the final norm, the codebook head table."""
    tensors = [*model.model.layers.parameters(), model.model.norm.weight, model.modality_head.weight]
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def kv_bytes(cfg: TalkerConfig, batch: int, context: float, elem: int) -> float:
    t = cfg.text
    return batch * context * t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * elem


def floor_ms(weights: float, kv: float, gathered: float, copy_bytes_per_s: float) -> float:
    return (weights + kv + gathered) / copy_bytes_per_s * 1e3


def graph_info(talker: HiggsTalker) -> dict:
    """What the engine reports about its attention backend, kernels and graphs."""
    eng = talker.engine
    attn = eng.runner.attn
    info = {
        "graph_mode": talker.graph_mode.value,
        "attention": type(attn).__name__,
        "kernels": talker.model.kernels.name,
        "fuse_qk_rope": talker.model.kernels.fuse_qk_rope,  # what runs (False where triton did not import)
        "row_gemv": getattr(talker.model.kernels, "row_gemv", "off"),  # "off" where triton did not import
        "row_linears": {k: list(v) for k, v in getattr(talker.model.kernels, "row_configs", {}).items()},
        "few_row_linears": {k: list(v) for k, v in getattr(talker.model.kernels, "few_row_configs", {}).items()},
        "bucket_kernels": {str(k): v for k, v in getattr(attn, "bucket_kernel", {}).items()},
        "graph_runner": None,
    }
    graphs = eng.graphs
    if graphs is not None:
        info["graph_runner"] = type(graphs).__name__
        info["graph_warmup_s"] = graphs.warmup_s
        info["graph_reason"] = graphs.decision.reason
        info["row_timings"] = graphs.row_timings
        info["kernel_timings"] = graphs.kernel_timings  # the decode-kernel measurement: alone and in the step
        info["choices"] = graphs.choices_source  # measured at this start, or read from the choice cache
        info["choice_sources"] = graphs.choice_sources
        info["choice_file"] = None if graphs.choice_file is None else str(graphs.choice_file)
        if graphs.choice:
            info["auto_choice"] = {str(k): v for k, v in graphs.choice.items()}
        if graphs.full is not None:
            info["sampler_variants"] = sorted(f"{size}:draw={d},filter={f}" for size, d, f in graphs.full.variants)
    return info


# ---------------------------------------------------------------------------------------------------------
# our engine


def time_engine(
    talker: HiggsTalker, batch: int, context: int, sampling: str, args: argparse.Namespace, wb: int, bw: float
) -> dict:
    """Add ``batch`` requests of ``context`` tokens sampled as ``sampling`` (a name in SAMPLINGS), prefill, warm
    up, time decode steps; returns the row."""
    eng, device = talker.engine, torch.device(args.device)
    frames = args.warmup + args.steps + 64
    prompts = [make_prompt(talker, context, seed=context * 1000 + i) for i in range(batch)]
    seeds = [args.seed + context * 1000 + i for i in range(batch)]
    ids = [eng.add_request(p, SamplingParams(**SAMPLINGS[sampling], seed=s, max_frames=frames))
           for p, s in zip(prompts, seeds, strict=True)]  # fmt: skip
    try:
        t0 = time.perf_counter()
        prefill_steps = 0
        while any(not eng.requests[i].rows for i in ids):
            eng.step()
            prefill_steps += 1
            if prefill_steps > batch + 16:
                raise RuntimeError(f"requests still waiting after {prefill_steps} steps (KV cache too small?)")
        sync(device)
        prefill_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            eng.step()
        reqs = [eng.requests[i] for i in ids]
        draw, filter_ = eng.scheduler._sampling_flags(reqs)  # which sampler graph these steps replay
        ctx_start = sum(r.num_computed for r in reqs) / batch
        timer, sizes = StepTimer(device), []
        for _ in range(args.steps):
            with timer:
                outs = eng.step()
            sizes.append(sum(1 for o in outs if o.row is not None))
        ms_all, host = timer.ms(), timer.host_ms()
        ctx_end = sum(r.num_computed for r in reqs) / batch
        finished = sorted({r.finish_reason for r in reqs if r.finish_reason})
    finally:
        for i in ids:
            eng.cancel(i)
            eng.requests.pop(i, None)
    full = [t for t, n in zip(ms_all, sizes, strict=True) if n == batch]
    if not full:
        raise RuntimeError(f"no step decoded the full batch of {batch} (finish reasons: {finished})")
    ms = median(full)
    kv_ctx = (ctx_start + ctx_end) / 2
    elem = torch.empty(0, dtype=eng.dtype).element_size()
    kvb = kv_bytes(talker.cfg, batch, kv_ctx, elem)
    gathered = batch * (1 + talker.cfg.num_codebooks) * talker.cfg.hidden_size * elem
    fl = floor_ms(wb, kvb, gathered, bw)
    return {
        "batch": batch,
        "context": context,
        "sampling": sampling,
        "sampling_params": SAMPLINGS[sampling],
        "sampler_draw": draw,  # some request samples (noise drawn)
        "sampler_filter": filter_,  # some request has top-k / top-p on (sort and filter run)
        "prompt_tokens": sum(len(p) for p in prompts) / batch,
        "ms_per_step": ms,
        "ms_p10": percentile(full, 10),
        "ms_p90": percentile(full, 90),
        "host_ms_per_step": median(h for h, n in zip(host, sizes, strict=True) if n == batch),
        "steps_timed": len(full),
        "steps_dropped": len(ms_all) - len(full),
        "floor_ms": fl,
        "ratio_to_floor": ms / fl,
        "frames_per_s": batch / (ms / 1e3),
        "audio_s_per_s": batch / (ms / 1e3) / talker.cfg.frame_rate,
        "kv_context_mean": kv_ctx,
        "weight_gb": wb / 1e9,
        "kv_gb": kvb / 1e9,
        "prefill_s": prefill_s,
        "prefill_steps": prefill_steps,
        "finish_reasons": finished,
        "status": "ok",
    }


def both(choice: str) -> list[bool]:
    return {"on": [True], "off": [False], "both": [True, False]}[choice]


def variants(args: argparse.Namespace) -> list[Variant]:
    """What to time: every mode x ``--fuse`` x ``--decode-kernels`` x ``--async`` x ``--head-kernels`` x
    ``--race-kernel`` (where the head kernels are on) x ``--sampler-variants`` x ``--row-gemv`` x ``--triton-qkv``
    (where QK-norm and RoPE are fused and the decode kernel can be triton) x ``--pdl`` x ``--few-rows``."""
    return [
        Variant(
            m,
            fuse,
            on,
            kernel,
            head_kernels=head,
            sampler_variants=sv,
            row_gemv=rows,
            race_kernel=race,
            triton_qkv=qkv,
            pdl=early,
            few_rows=few,
        )
        for m in args.modes
        for fuse in both(args.fuse)
        for kernel in args.decode_kernels
        for on in both(args.async_scheduling)
        for head in both({"fused": "on", "torch": "off", "both": "both"}[args.head_kernels])
        for race in (both(args.race_kernel) if head else [True])
        for sv in both(args.sampler_variants)
        for rows in args.row_gemv
        for qkv in (both(args.triton_qkv) if fuse and kernel in ("auto", "triton") else [True])
        for early in both(args.pdl)
        for few in both(args.few_rows)
    ]


def run_mode(variant: Variant, cfg: TalkerConfig, args, writer: ResultFile, bw: float, share_s: float) -> None:
    """Time every (context, batch) point of one variant; points left after ``share_s`` seconds of timing (build,
    warm-up and first-use kernel compilation not counted) are recorded as skipped."""
    fused.ENABLED = variant.head_kernels  # from the build on: graphs capture the path the variant uses
    race = {"sampler race"}
    fused.DISABLED = set(DEFAULT_DISABLED - race if variant.race_kernel else DEFAULT_DISABLED | race)
    full_graphs.SAMPLER_VARIANTS = DEFAULT_SAMPLER_VARIANTS if variant.sampler_variants else ()
    flashinfer_attention.TRITON_TAKES_QKV = variant.triton_qkv
    pdl.ENABLED = variant.pdl
    gemv = _triton_gemv()
    if gemv is not None:  # no few-row tile to try: those inputs stay on cuBLAS (the choice cache's key says so)
        gemv.FEW_ROW_CONFIGS = DEFAULT_FEW_ROW_CONFIGS if variant.few_rows else ()
    try:
        _run_variant(variant, cfg, args, writer, bw, share_s)
    finally:
        if gemv is not None:
            gemv.FEW_ROW_CONFIGS = DEFAULT_FEW_ROW_CONFIGS
        fused.ENABLED, full_graphs.SAMPLER_VARIANTS = True, DEFAULT_SAMPLER_VARIANTS
        flashinfer_attention.TRITON_TAKES_QKV, pdl.ENABLED = DEFAULT_TRITON_QKV, DEFAULT_PDL
        fused.DISABLED = set(DEFAULT_DISABLED)


def _run_variant(variant: Variant, cfg: TalkerConfig, args, writer: ResultFile, bw: float, share_s: float) -> None:
    points = [(c, b, s) for c in args.contexts for b in args.batches for s in args.sampling]
    label = variant.label
    base = {"mode": label, "async_scheduling": variant.async_scheduling, "decode_kernel_option": variant.kernel}
    t0 = time.perf_counter()
    try:
        talker = build_talker(args, cfg, variant, num_blocks_for(args))
        if not args.model:
            suppress_eoc(talker)
        talker.generate("warm up", SamplingParams(temperature=0.0), max_frames=2)  # first-use kernel compiles
        sync(torch.device(args.device))
    except Exception as exc:  # noqa: BLE001 - e.g. a graph mode the engine does not support yet
        for c, b, s in points:
            writer.add(base | {"batch": b, "context": c, "sampling": s, "status": "error",
                               "error": f"build: {error_text(exc)}"})  # fmt: skip
        log(f"{label}: build failed: {error_text(exc)}")
        free_memory(torch.device(args.device))
        return
    build_s = time.perf_counter() - t0
    deadline = time.perf_counter() + share_s
    info = graph_info(talker)
    log(f"{label}: built in {build_s:.1f} s ({info})")
    wb = weight_bytes(talker.model)
    for c, b, s in points:
        if time.perf_counter() > deadline:
            writer.add(base | {"batch": b, "context": c, "sampling": s, "status": "skipped", "error": "time budget"})
            continue
        try:
            row = base | time_engine(talker, b, c, s, args, wb, bw) | {"build_s": build_s} | info
            row["frame_kernels"] = frame_kernel_states()
        except Exception as exc:  # noqa: BLE001 - one shape's failure must not lose the others
            row = base | {"batch": b, "context": c, "sampling": s, "status": "error", "error": error_text(exc)} | info
        writer.add(row)
        log(
            f"{label:20s} {s:7s} b={b:<3d} ctx={c:<5d} {row.get('ms_per_step', float('nan')):7.2f} ms/step "
            f"(floor {row.get('floor_ms', float('nan')):.2f}) {row['status']} {row.get('error', '')}"
        )
    del talker
    free_memory(torch.device(args.device))


def frame_kernel_states() -> dict[str, str]:
    """What each frame kernel did by the end of a timed point: ``disabled`` (the variant turned it off), else
    ``heads.fused.state``: ``ok`` (checked, in use), ``off`` (failed its first-use check or errored: the torch
    reference ran in its place, so an A/B of it measured nothing) or ``untried`` (no call it takes, or not CUDA)."""
    if not fused.ENABLED:
        return dict.fromkeys(FRAME_KERNELS, "disabled")
    return {name: "disabled" if name in fused.DISABLED else fused.state(name) for name in FRAME_KERNELS}


def num_blocks_for(args: argparse.Namespace) -> int:
    per_seq = -(-(max(args.contexts) + args.warmup + args.steps + 80) // 16)
    return max(args.batches) * per_seq + 64


# ---------------------------------------------------------------------------------------------------------
# transformers peers


def build_hf_peer(talker: HiggsTalker, dtype: torch.dtype, device: torch.device):
    """transformers Qwen3ForCausalLM with our shape and weights; lm_head is our codebook table [8 * V, H]."""
    from transformers import Qwen3ForCausalLM

    t = talker.cfg.text
    hcfg = t.to_qwen3_config(tie_word_embeddings=False)
    ours = talker.model
    table = ours.modality_head.weight
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(hcfg)
        hf.lm_head = torch.nn.Linear(t.hidden_size, table.shape[0], bias=False)
    hf = hf.to(dtype).to_empty(device=device)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hcfg).to(device)  # to_empty left its buffers garbage

    params = dict(hf.named_parameters())
    done: set[str] = set()

    def put(name: str, value: torch.Tensor) -> None:
        params[name].data.copy_(value)
        done.add(name)

    qs, kvs, inter = t.q_size, t.kv_size, t.intermediate_size
    put("model.embed_tokens.weight", ours.model.embed_tokens.weight)
    for i, layer in enumerate(ours.model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.self_attn.qkv_proj.weight.split([qs, kvs, kvs])
        gate, up = layer.mlp.gate_up_proj.weight.split([inter, inter])
        for name, value in {
            "input_layernorm.weight": layer.input_layernorm.weight,
            "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            "self_attn.q_proj.weight": q,
            "self_attn.k_proj.weight": k,
            "self_attn.v_proj.weight": v,
            "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
            "self_attn.q_norm.weight": layer.self_attn.q_norm.weight,
            "self_attn.k_norm.weight": layer.self_attn.k_norm.weight,
            "mlp.gate_proj.weight": gate,
            "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": layer.mlp.down_proj.weight,
        }.items():
            put(p + name, value)
        if t.attention_bias:
            qb, kb, vb = layer.self_attn.qkv_proj.bias.split([qs, kvs, kvs])
            put(p + "self_attn.q_proj.bias", qb)
            put(p + "self_attn.k_proj.bias", kb)
            put(p + "self_attn.v_proj.bias", vb)
    put("model.norm.weight", ours.model.norm.weight)
    put("lm_head.weight", table)
    missing = sorted(set(params) - done)
    if missing:
        raise RuntimeError(f"peer parameters not copied from ours: {missing[:5]}")
    return hf.eval().requires_grad_(False)


@torch.inference_mode()
def peer_check(talker: HiggsTalker, hf, device: torch.device, tokens: int = 48) -> float:
    """Relative difference of the codebook logits of the last prompt position, ours vs the peer."""
    from higgs_talker.attention import SdpaAttention, use_backend
    from higgs_talker.batch import StepBatch
    from higgs_talker.kv_cache import allocate_kv_caches

    t = talker.cfg.text
    ids = torch.randint(0, min(t.vocab_size, 256), (tokens,), device=device, generator=None)
    blocks = -(-tokens // 16)
    caches = allocate_kv_caches(t, blocks, 16, talker.engine.dtype, device)
    attn = SdpaAttention(caches, t.num_attention_heads, t.num_key_value_heads, t.head_dim, tokens)
    positions = list(range(tokens))
    attn.plan(StepBatch([0], positions, positions, [tokens], [tokens], [list(range(blocks))], token_ids=ids.tolist()))
    model = talker.model
    with use_backend(attn):
        hidden = model(model.embed_text(ids), torch.arange(tokens, device=device))
    ours = model.modality_head(hidden[-1:]).float().flatten()
    theirs = hf(input_ids=ids[None], logits_to_keep=1).logits[0, -1].float()
    return float((ours - theirs).norm() / theirs.norm())


def _forward_kwargs(hf) -> tuple[str, bool]:
    """The cache keyword of this transformers version and whether forward takes cache_position."""
    params = inspect.signature(type(hf).forward).parameters
    return ("past_key_values" if "past_key_values" in params else "cache"), "cache_position" in params


@torch.inference_mode()
def time_hf(hf, mode: str, batch: int, context: int, args, bw: float, cfg: TalkerConfig) -> dict:
    """Prefill ``batch`` x ``context`` random tokens, then time greedy decode steps (one host read per step): the
    argmax of the last position's logits, no sampling."""
    from transformers import DynamicCache, StaticCache

    device = torch.device(args.device)
    cache_kw, takes_cache_pos = _forward_kwargs(hf)
    max_len = context + args.warmup + args.steps + 16
    compiled = mode == "hf_static_compile"
    warmup = max(args.warmup, 4) if compiled else args.warmup
    if compiled:
        try:
            cache = StaticCache(config=hf.config, max_cache_len=max_len)
        except TypeError:
            cache = StaticCache(config=hf.config, max_batch_size=batch, max_cache_len=max_len, device=device,
                                dtype=next(hf.parameters()).dtype)  # fmt: skip
    else:
        try:
            cache = DynamicCache(config=hf.config)
        except TypeError:
            cache = DynamicCache()
    ids = torch.randint(0, min(cfg.text.vocab_size, 256), (batch, context), device=device)

    def call(fn, tokens, start):
        n = tokens.shape[1]
        kw = {cache_kw: cache, "use_cache": True, "logits_to_keep": 1}
        kw["position_ids"] = torch.arange(start, start + n, device=device)[None].expand(batch, n)
        if takes_cache_pos:
            kw["cache_position"] = torch.arange(start, start + n, device=device)
        return fn(input_ids=tokens, **kw)

    t0 = time.perf_counter()
    out = call(hf, ids, 0)  # prefill, eager in both modes
    tok = out.logits[:, -1].argmax(-1, keepdim=True) % cfg.text.vocab_size
    sync(device)
    prefill_s = time.perf_counter() - t0
    fn, fullgraph = (_compile(hf, fullgraph=True), True) if compiled else (hf, None)

    def step(fn, tok, pos):
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        # the head is the codebook table: fold its argmax into the text vocabulary (the tiny one is smaller)
        return call(fn, tok, pos).logits[:, -1].argmax(-1, keepdim=True) % cfg.text.vocab_size

    pos = context
    t0 = time.perf_counter()
    for j in range(warmup):
        try:
            tok = step(fn, tok, pos)
        except Exception:  # noqa: BLE001 - a graph break under fullgraph: compile again without it
            if not (compiled and fullgraph and j == 0):
                raise
            torch._dynamo.reset()
            fn, fullgraph = _compile(hf, fullgraph=False), False
            tok = step(fn, tok, pos)
        pos += 1
    sync(device)
    warm_s = time.perf_counter() - t0
    timer = StepTimer(device)
    for _ in range(args.steps):
        with timer:
            tok = step(fn, tok, pos)
            tok.cpu()  # the per-step host read our engine also does
        pos += 1
    times = timer.ms()
    ms = median(times)
    elem = next(hf.parameters()).element_size()
    wb = sum(p.numel() * p.element_size() for p in hf.model.layers.parameters())
    wb += hf.model.norm.weight.numel() * elem + hf.lm_head.weight.numel() * elem
    kv_ctx = context + warmup + args.steps / 2
    kvb = kv_bytes(cfg, batch, kv_ctx, elem)
    fl = floor_ms(wb, kvb, batch * cfg.hidden_size * elem, bw)
    return {
        "batch": batch,
        "context": context,
        "ms_per_step": ms,
        "ms_p10": percentile(times, 10),
        "ms_p90": percentile(times, 90),
        "steps_timed": len(times),
        "floor_ms": fl,
        "ratio_to_floor": ms / fl,
        "frames_per_s": batch / (ms / 1e3),
        "audio_s_per_s": batch / (ms / 1e3) / cfg.frame_rate,
        "kv_context_mean": kv_ctx,
        "prefill_s": prefill_s,
        "warmup_s": warm_s,
        "fullgraph": fullgraph,
        "status": "ok",
    }


def _compile(hf, fullgraph: bool):
    """torch.compile(mode="reduce-overhead") of the peer's forward (transformers' static-cache recipe)."""
    return torch.compile(hf.forward, mode="reduce-overhead", fullgraph=fullgraph)


def run_peers(cfg: TalkerConfig, args, writer: ResultFile, bw: float) -> None:
    device = torch.device(args.device)
    try:
        talker = build_talker(args, cfg, Variant("eager", async_scheduling=None), num_blocks=64)
        if not args.model:
            suppress_eoc(talker)
        dtype = next(talker.model.parameters()).dtype
        hf = build_hf_peer(talker, dtype, device)
        try:
            writer.meta["peer_rel_err"] = peer_check(talker, hf, device)
        except Exception as exc:  # noqa: BLE001
            writer.meta["peer_rel_err"] = f"check failed: {error_text(exc)}"
        log(f"peer built; logits rel. diff vs ours: {writer.meta['peer_rel_err']}")
        del talker
        free_memory(device)
    except Exception as exc:  # noqa: BLE001
        for mode in ("hf_eager", "hf_static_compile"):
            writer.add({"mode": mode, "batch": args.peer_batches[0], "context": args.contexts[0], "sampling": "greedy",
                        "status": "error", "error": f"peer build: {error_text(exc)}"})  # fmt: skip
        return
    plan = [("hf_eager", c, b) for c in args.contexts for b in args.peer_batches]
    plan += [("hf_static_compile", c, b) for c in args.peer_contexts for b in args.peer_batches]
    for mode, c, b in plan:
        base = {"mode": mode, "batch": b, "context": c, "sampling": "greedy"}
        if mode == "hf_static_compile" and device.type != "cuda":
            writer.add(base | {"status": "skipped", "error": "reduce-overhead needs CUDA graphs"})
            continue
        try:
            row = base | time_hf(hf, mode, b, c, args, bw, cfg)
        except Exception as exc:  # noqa: BLE001
            row = base | {"status": "error", "error": error_text(exc)}
            if mode == "hf_static_compile":
                torch._dynamo.reset()
        writer.add(row)
        log(f"{mode:18s} b={b:<3d} ctx={c:<5d} {row.get('ms_per_step', float('nan')):7.2f} ms/step {row['status']} "
            f"{row.get('error', '')}")  # fmt: skip
    del hf
    torch._dynamo.reset()
    free_memory(device)


# ---------------------------------------------------------------------------------------------------------
# output


PEERS = ("hf_eager", "hf_static_compile")


def final_table(rows: list[dict], modes: Sequence[str], samplings: Sequence[str]) -> None:
    """One row per (context, batch): ms/step of every mode at every sampling (the first sampling, the headline,
    first), the transformers peers (greedy), the floor, and each sampling's best mode's ratio to it."""
    ok = [r for r in rows if r.get("status") == "ok"]
    by = {(r["mode"], r.get("sampling", "greedy"), r["context"], r["batch"]): r for r in ok}
    points = sorted({(r["context"], r["batch"]) for r in rows if r.get("mode") in modes})
    series = [(m, s) for s in samplings for m in modes]

    def name(m: str, s: str) -> str:
        return f"{m} {s}" if len(samplings) > 1 else m

    table = []
    for c, b in points:
        row = {"context": c, "batch": b}
        best: dict[str, dict] = {}
        for m, s in series:
            r = by.get((m, s, c, b))
            row[name(m, s)] = r["ms_per_step"] if r else None
            if r:
                row["floor"] = r["floor_ms"]
                if s not in best or r["ms_per_step"] < best[s]["ms_per_step"]:
                    best[s] = r
        for peer in PEERS:
            r = by.get((peer, "greedy", c, b))
            if r:
                row[f"{peer} greedy"] = r["ms_per_step"]
        for s in samplings:
            row[f"best/floor {s}"] = best[s]["ratio_to_floor"] if s in best else None
            row[f"audio_s/s {s}"] = best[s]["audio_s_per_s"] if s in best else None
        table.append(row)
    cols = ["context", "batch", *(name(m, s) for m, s in series)]
    cols += [f"{p} greedy" for p in PEERS if any(f"{p} greedy" in r for r in table)]
    cols += ["floor", *(f"best/floor {s}" for s in samplings), *(f"audio_s/s {s}" for s in samplings)]
    title = f"\nms per decode step (sampling: {', '.join(samplings)}; the first is the headline)"
    print_table(table, cols, title=title)
    for c, b in points:
        for peer in PEERS:
            ours = [by[(m, "greedy", c, b)]["ms_per_step"] for m in modes if (m, "greedy", c, b) in by]
            if ours and (peer, "greedy", c, b) in by:
                ratio = by[(peer, "greedy", c, b)]["ms_per_step"] / min(ours)
                print(f"  {peer} / best of ours, both greedy, at batch {b}, context {c}: {ratio:.2f}x")
        for m in modes:
            if (m, "deploy", c, b) in by and (m, "greedy", c, b) in by:
                ratio = by[(m, "deploy", c, b)]["ms_per_step"] / by[(m, "greedy", c, b)]["ms_per_step"]
                print(f"  {m} deploy / greedy at batch {b}, context {c}: {ratio:.3f}x (time)")
            for s in samplings:  # the A/Bs, where both halves ran
                for off, on, what in ((m, m + FUSED, "unfused / fused"), (m + SYNC, m, "sync / async")):
                    if (off, s, c, b) in by and (on, s, c, b) in by:
                        ratio = by[(off, s, c, b)]["ms_per_step"] / by[(on, s, c, b)]["ms_per_step"]
                        print(f"  {off} / {on} ({s}) at batch {b}, context {c}: {ratio:.3f}x (time {what})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--model", default=None, help="checkpoint directory (default: random weights)")
    p.add_argument("--tiny", action="store_true", help="the tiny config, small sizes, few steps")
    p.add_argument("--modes", type=strs_arg, default=list(MODES))
    p.add_argument("--fuse", choices=("on", "off", "both"), default="on",
                   help="QK-norm + RoPE + K/V writes in one Triton kernel (on, the library's default: MODE-fused "
                   "rows), not (off: MODE rows), or each mode both ways")  # fmt: skip
    p.add_argument("--async", dest="async_scheduling", choices=("on", "off", "both"), default="on",
                   help="asynchronous scheduling (on, the CUDA default), synchronous steps (off: MODE-sync rows), "
                   "or both")  # fmt: skip
    p.add_argument("--decode-kernels", type=strs_arg, default=["auto"],
                   help=f"decode attention kernels to pin, each timed apart (of {', '.join(DECODE_KERNELS)}; "
                   "default auto: measured per bucket)")  # fmt: skip
    p.add_argument("--head-kernels", choices=("fused", "torch", "both"), default="fused",
                   help="the frame's noise hash, delay mask and state update: Triton kernels (fused, the CUDA "
                   "default), torch operations (MODE-torchhead rows), or both")  # fmt: skip
    p.add_argument("--race-kernel", choices=("on", "off", "both"), default="on",
                   help="a sampled step's top-k/top-p filter, noise and race as one Triton kernel (on, the CUDA "
                   "default) or torch operations around the noise kernel (off: MODE-torchrace rows), or both",
                   )  # fmt: skip
    p.add_argument("--sampler-variants", choices=("on", "off", "both"), default="on",
                   help="full-decode graphs with the cheaper sampler variants (on, the default), the whole sampler "
                   "only (off: MODE-wholesampler rows), or both")  # fmt: skip
    p.add_argument("--triton-qkv", choices=("on", "off", "both"), default="on",
                   help="where the decode kernel is triton: QK-norm, RoPE and the K/V write inside its launch (on, "
                   "the default), the separate fused kernel before it (off: MODE-qkvapart rows), or both")  # fmt: skip
    p.add_argument("--pdl", choices=("on", "off", "both"), default="on",
                   help="our Triton GEMV and decode attention launched with programmatic dependent launch on Hopper "
                   "(on, the default), without (off: MODE-nopdl rows), or both")  # fmt: skip
    p.add_argument("--few-rows", choices=("on", "off", "both"), default="on",
                   help="inputs of 2-16 rows on our few-row Triton kernel where row_gemv chooses it (on, the "
                   "default) or on cuBLAS (off: MODE-cublasfew rows), or both")  # fmt: skip
    p.add_argument("--row-gemv", type=strs_arg, default=["auto"],
                   help="row_gemv options to time, each apart (of auto, on, off; default auto)")  # fmt: skip
    add_sampling_option(p, "point")
    p.add_argument("--batches", type=ints_arg, default=None, help="default 1,2,4,8,13,16,32,64")
    p.add_argument("--contexts", type=ints_arg, default=None, help="default 512,2048")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per point (default 24)")
    p.add_argument("--warmup", type=int, default=None, help="untimed decode steps first (default 6)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the engine's (max_position_embeddings)")
    p.add_argument("--no-peers", action="store_true", help="skip the transformers rows")
    p.add_argument("--peer-batches", type=ints_arg, default=[1])
    p.add_argument(
        "--peer-contexts", type=ints_arg, default=None, help="contexts of the compiled peer (default: first)"
    )
    p.add_argument("--budget-s", type=float, default=420.0, help="skip remaining points after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results)")
    args = p.parse_args(argv)
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {list(MODES)}")
    bad = [k for k in args.decode_kernels if k not in DECODE_KERNELS]
    if bad:
        p.error(f"unknown decode kernel(s) {bad}; choose from {list(DECODE_KERNELS)}")
    bad = [r for r in args.row_gemv if r not in ROW_GEMV_LABELS]
    if bad:
        p.error(f"unknown row_gemv option(s) {bad}; choose from {list(ROW_GEMV_LABELS)}")
    if not args.no_peers and args.budget_s <= PEER_RESERVE_S:
        p.error(f"--budget-s {args.budget_s:g} leaves no time for our modes: {PEER_RESERVE_S:g} s of it are kept for "
                "the transformers peers; raise it or pass --no-peers")  # fmt: skip
    if args.tiny:
        args.batches = args.batches or [1, 3]
        args.contexts = args.contexts or [24, 48]
        args.steps = args.steps or 5
        args.warmup = args.warmup if args.warmup is not None else 2
    args.batches = args.batches or [1, 2, 4, 8, 13, 16, 32, 64]
    args.contexts = args.contexts or [512, 2048]
    args.steps = args.steps or 24
    args.warmup = args.warmup if args.warmup is not None else 6
    args.peer_contexts = args.peer_contexts or args.contexts[:1]
    args.max_num_seqs = max(args.max_num_seqs, max(args.batches))
    return args


def main(argv: Sequence[str] | None = None) -> ResultFile:
    args = parse_args(argv)
    device = resolve_device(args.device)
    t_start = time.perf_counter()
    cfg = model_config(args)
    bw = copy_bandwidth(device)
    meta = environment(device, "bench_decode.py", argv)
    meta |= {
        "copy_tb_per_s": bw["tb_per_s"],
        "model": args.model or ("tiny (random)" if args.tiny else "4B shape (random)"),
        "shape": dataclasses.asdict(cfg.text),
        "num_codebooks": cfg.num_codebooks,
        "codebook_size": cfg.codebook_size,
        "eoc_suppressed": not args.model,
        "steps": args.steps,
        "warmup": args.warmup,
        "max_model_len": args.max_model_len,
        "floor_counts": "layers + final norm + codebook table + gathered embedding rows + KV (batch x context)",
        "samplings": {s: SAMPLINGS[s] for s in args.sampling},
        "headline_sampling": args.sampling[0],
        "sampler_graphs": "full-decode graphs replay the whole sampler where some request has top-k / top-p on "
        "(sampler_filter), the no-filter variant where some samples without them, the argmax variant where all "
        "are greedy (sampler_draw false)",
        "peers": "transformers Qwen3ForCausalLM, our weights, the codebook table as lm_head: each step feeds back "
        "the argmax of the last position's logits (greedy; no sampler, no delay pattern, no frame state)",
    }
    writer = ResultFile(args.out, "decode", meta, smoke=args.tiny)
    log(f"copy ceiling {bw['tb_per_s']:.2f} TB/s; writing {writer.path}")
    deadline = t_start + args.budget_s - (0 if args.no_peers else PEER_RESERVE_S)
    todo = variants(args)
    for n, variant in enumerate(todo):  # each variant gets an equal share of the time left
        now = time.perf_counter()
        run_mode(variant, cfg, args, writer, bw["bytes_per_s"], max(deadline - now, 0.0) / (len(todo) - n))
    if not args.no_peers:
        run_peers(cfg, args, writer, bw["bytes_per_s"])
    writer.meta["wall_s"] = time.perf_counter() - t_start
    writer.save()
    final_table(writer.rows, [v.label for v in todo], args.sampling)
    print(f"\nwrote {writer.path} ({writer.meta['wall_s']:.0f} s)")
    return writer


if __name__ == "__main__":
    main()
