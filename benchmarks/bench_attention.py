"""Attention-only microbenchmark for the Higgs decode shape: FlashInfer native paged decode vs XQA vs torch SDPA.

The shape is what one talker layer does per decode step: bf16, 32 query / 8 KV heads, head_dim 128, one query
token per request, a paged KV cache (page 16 or 32, NHD or HND). For every (batch, context, page, layout)
the script fills fresh random caches, computes a float64 reference on the GPU from the same paged cache,
then for each variant: poisons the output, runs once and checks it; captures a CUDA graph of several calls;
times replays with CUDA events (median of repeats, warm-up excluded); checks the output again after the
replays (a moving error is a race).

Variants
- ``fi_native``: ``BatchDecodeWithPagedKVCacheWrapper`` (CUDA-core decode, ``use_cuda_graph=True``).
- ``fi_native_tc``: the same wrapper with ``use_tensor_cores=True``.
- ``xqa_own``: ``trtllm_batch_decode_with_kv_cache(backend="xqa")`` with its own zeroed workspace.
- ``xqa_shared``: the same, given the native wrapper's float workspace (first run right after native runs).
- ``xqa_wide``: own workspace, but a block table as wide as a 32768-token ``max_model_len`` (as vLLM passes
  it); XQA sizes its multi-block split from the table width, not from the actual lengths.
- ``xqa_1block``: ``flashinfer.xqa.xqa`` called directly with ``sm_count = batch * kv_heads``, which turns
  XQA's multi-block (split-KV) mode off: the multi-block threshold and what it buys.
- ``sdpa_engine``: the engine's reference backend (``higgs_talker.attention.SdpaAttention``: KV write, page
  gather, masked SDPA), NHD only.
- ``sdpa_dense``: SDPA over already-contiguous K/V (a lower bound for an SDPA-based path).

To keep KV reads out of L2 (as in a real step, where ~200 MB of weights pass between two layers' attention)
each graph cycles through several copies of the cache, at least ``--rotate-mb`` in all.

    python benchmarks/bench_attention.py --out $OUT            # full sweep (H200: ~1 min + JIT when fresh)
    python benchmarks/bench_attention.py --quick --out $OUT    # the GPU.md grid plus a few extensions
    python benchmarks/bench_attention.py --device cpu --tiny   # smoke: tiny shape, SDPA only, seconds
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from common import (
    ResultFile,
    capture_graph,
    copy_bandwidth,
    environment,
    error_text,
    free_memory,
    ints_arg,
    log,
    median,
    print_table,
    rel_err,
    resolve_device,
    strs_arg,
    sync,
    time_fn,
)
from torch import Tensor

HIGGS_HEADS = (32, 8, 128)  # query heads, KV heads, head_dim
TINY_HEADS = (4, 2, 32)
WORKSPACE_BYTES = 128 << 20
XQA_SEMAPHORE_BYTES = 8 << 20  # flashinfer's xqa wrapper reserves the workspace's first 8 MB for semaphores
XQA_CTA_TOKENS = 256  # XQA's (bf16, sm90) CTA tile along the sequence: one sub-sequence covers >= 1 tile
WRONG_REL_ERR = 2e-2  # bf16 outputs land near 2e-3..5e-3; far above that is a wrong result

ALL_VARIANTS = (
    "fi_native",
    "fi_native_tc",
    "xqa_own",
    "xqa_shared",
    "xqa_wide",
    "xqa_1block",
    "sdpa_engine",
    "sdpa_dense",
)
FLASHINFER_VARIANTS = {v for v in ALL_VARIANTS if not v.startswith("sdpa")}


@dataclass(frozen=True)
class Item:
    """One grid point: a paged-cache shape and the variants to run on it."""

    group: str
    batch: int
    context: int
    page_size: int
    layout: str
    variants: tuple[str, ...]


@dataclass
class Case:
    """Random paged caches (``copies`` of them, one page table) and queries for one grid point."""

    item: Item
    heads: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device
    copies: int
    caches: list[Tensor] = field(default_factory=list)  # NHD [P, 2, page, Hk, D] / HND [P, 2, Hk, page, D]
    queries: list[Tensor] = field(default_factory=list)  # [B, Hq, D]
    block_table: Tensor | None = None  # [B, pages_per_seq] int32
    seq_lens: Tensor | None = None  # [B] int32
    indptr: Tensor | None = None  # [B+1] int32
    indices: Tensor | None = None  # [B * pages_per_seq] int32
    last_page_len: Tensor | None = None  # [B] int32

    @property
    def pages_per_seq(self) -> int:
        return -(-self.item.context // self.item.page_size)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V one call must read (the useful bytes)."""
        hq, hk, d = self.heads
        return 2 * self.item.batch * self.item.context * hk * d * self.caches[0].element_size()

    @property
    def io_bytes(self) -> int:
        hq, hk, d = self.heads
        return self.kv_bytes + 2 * self.item.batch * hq * d * self.caches[0].element_size()

    def build(self, seed: int) -> Case:
        it, (hq, hk, d) = self.item, self.heads
        g = torch.Generator(device=self.device).manual_seed(seed)
        pages = it.batch * self.pages_per_seq
        shape = (pages, 2, it.page_size, hk, d) if it.layout == "NHD" else (pages, 2, hk, it.page_size, d)
        for _ in range(self.copies):
            self.caches.append(torch.randn(shape, generator=g, device=self.device, dtype=self.dtype))
            self.queries.append(torch.randn(it.batch, hq, d, generator=g, device=self.device, dtype=self.dtype))
        perm = torch.randperm(pages, generator=g, device=self.device).to(torch.int32)  # scattered pages
        self.block_table = perm.view(it.batch, self.pages_per_seq).contiguous()
        self.seq_lens = torch.full((it.batch,), it.context, dtype=torch.int32, device=self.device)
        self.indptr = torch.arange(it.batch + 1, dtype=torch.int32, device=self.device) * self.pages_per_seq
        self.indices = self.block_table.flatten().contiguous()
        last = it.context - (self.pages_per_seq - 1) * it.page_size
        self.last_page_len = torch.full((it.batch,), last, dtype=torch.int32, device=self.device)
        return self

    def gather_kv(self, copy: int, rows: slice) -> tuple[Tensor, Tensor]:
        """Contiguous K, V [b, Hk, L, D] of requests ``rows`` from cache ``copy`` (the cache dtype)."""
        cache = self.caches[copy]
        kv = cache[self.block_table[rows].long()]  # [b, P, 2, page, Hk, D] (NHD) or [b, P, 2, Hk, page, D]
        if self.item.layout == "HND":
            kv = kv.transpose(3, 4)
        b, p, _, page, hk, d = kv.shape
        k = kv[:, :, 0].reshape(b, p * page, hk, d)[:, : self.item.context].transpose(1, 2)
        v = kv[:, :, 1].reshape(b, p * page, hk, d)[:, : self.item.context].transpose(1, 2)
        return k, v

    def reference(self, copy: int = 0) -> Tensor:
        """float64 attention output [B, Hq, D] of cache ``copy``, computed on the device in chunks of requests."""
        hq, hk, d = self.heads
        per_req = 2 * self.item.context * hk * d * 8
        chunk = max(1, (1 << 30) // per_req)
        outs = []
        for start in range(0, self.item.batch, chunk):
            rows = slice(start, min(start + chunk, self.item.batch))
            k, v = (t.double() for t in self.gather_kv(copy, rows))  # [b, Hk, L, D]
            q = self.queries[copy][rows].double().view(-1, hk, hq // hk, d)  # query head h uses KV head h // group
            scores = torch.einsum("bhgd,bhld->bhgl", q, k) * d**-0.5
            outs.append(torch.einsum("bhgl,bhld->bhgd", scores.softmax(-1), v).reshape(-1, hq, d))
        return torch.cat(outs)


# ---------------------------------------------------------------------------------------------------------
# variants: set up in __init__ (plans, tables, workspaces); call(i) runs on cache copy i into self.outs[i]


class Variant:
    name = ""
    poisonable = True  # writes into a preallocated output we can fill with NaN first

    def __init__(self, case: Case, ctx: Context) -> None:
        self.case, self.ctx = case, ctx
        self.outs = [torch.empty_like(q) for q in case.queries]
        self.info: dict = {}

    def call(self, i: int) -> None:
        raise NotImplementedError


class FiNative(Variant):
    name = "fi_native"
    tensor_cores = False

    def __init__(self, case: Case, ctx: Context) -> None:
        super().__init__(case, ctx)
        import flashinfer

        it, (hq, hk, d) = case.item, case.heads
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ctx.native_workspace,
            kv_layout=it.layout,
            use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=torch.empty_like(case.indptr),
            paged_kv_indices_buffer=torch.empty_like(case.indices),
            paged_kv_last_page_len_buffer=torch.empty_like(case.last_page_len),
        )
        t0 = time.perf_counter()
        self.wrapper.plan(
            case.indptr,
            case.indices,
            case.last_page_len,
            hq,
            hk,
            d,
            it.page_size,
            pos_encoding_mode="NONE",
            q_data_type=case.dtype,
            kv_data_type=case.dtype,
        )
        sync(case.device)
        self.info["plan_us"] = (time.perf_counter() - t0) * 1e6

    def call(self, i: int) -> None:
        self.wrapper.run(self.case.queries[i], self.case.caches[i], out=self.outs[i])


class FiNativeTC(FiNative):
    name = "fi_native_tc"
    tensor_cores = True


class Xqa(Variant):
    """``trtllm_batch_decode_with_kv_cache(backend="xqa")`` as vLLM's FlashInfer backend calls it."""

    name = "xqa_own"
    wide = False

    def __init__(self, case: Case, ctx: Context) -> None:
        super().__init__(case, ctx)
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache

        self.fn = trtllm_batch_decode_with_kv_cache
        self.workspace = self.pick_workspace()
        self.table = case.block_table
        if self.wide:
            width = -(-ctx.args.wide_len // case.item.page_size)
            self.table = torch.zeros(case.item.batch, width, dtype=torch.int32, device=case.device)
            self.table[:, : case.pages_per_seq] = case.block_table
        self.info["xqa_sub_seqs"] = xqa_sub_seqs(
            ctx.sm_count, case.item.batch, case.heads[1], self.table.shape[1] * case.item.page_size
        )
        self.info["table_width"] = int(self.table.shape[1])

    def pick_workspace(self) -> Tensor:
        return self.ctx.xqa_workspace

    def call(self, i: int) -> None:
        c = self.case
        self.fn(
            query=c.queries[i],
            kv_cache=c.caches[i],
            workspace_buffer=self.workspace,
            block_tables=self.table,
            seq_lens=c.seq_lens,
            max_seq_len=c.item.context,
            bmm1_scale=c.heads[2] ** -0.5,
            bmm2_scale=1.0,
            out=self.outs[i],
            kv_layout=c.item.layout,
            backend="xqa",
        )


class XqaShared(Xqa):
    name = "xqa_shared"

    def pick_workspace(self) -> Tensor:
        return self.ctx.native_workspace


class XqaWide(Xqa):
    name = "xqa_wide"
    wide = True


class XqaOneBlock(Variant):
    """``flashinfer.xqa.xqa`` with ``sm_count = batch * kv_heads``: one CTA per (request, KV head), no split."""

    name = "xqa_1block"

    def __init__(self, case: Case, ctx: Context) -> None:
        super().__init__(case, ctx)
        from flashinfer.xqa import xqa

        self.fn = xqa
        ws = ctx.xqa_workspace.view(torch.uint8)
        self.semaphores, self.scratch = ws[:XQA_SEMAPHORE_BYTES], ws[XQA_SEMAPHORE_BYTES:]
        self.sm_count = case.item.batch * case.heads[1]
        self.info["xqa_sub_seqs"] = 1

    def call(self, i: int) -> None:
        c = self.case
        k, v = c.caches[i].unbind(1)
        self.fn(
            c.queries[i].unsqueeze(1),  # [B, beam 1, Hq, D]
            k,
            v,
            c.block_table,
            c.seq_lens.unsqueeze(1),  # [B, beam 1]; int32 bits read as uint32
            self.outs[i].unsqueeze(1),
            self.scratch,
            self.semaphores,
            c.heads[1],
            c.item.page_size,
            q_scale=1.0,  # = bmm1_scale / kv_scale * sqrt(D) with bmm1_scale = 1 / sqrt(D)
            kv_scale=1.0,
            kv_layout=c.item.layout,
            sm_count=self.sm_count,
        )


class SdpaEngine(Variant):
    """The engine's reference backend, one decode step: write the new K/V, gather pages, masked SDPA."""

    name = "sdpa_engine"
    poisonable = False

    def __init__(self, case: Case, ctx: Context) -> None:
        super().__init__(case, ctx)
        from higgs_talker.attention import SdpaAttention
        from higgs_talker.batch import StepBatch

        if case.item.layout != "NHD":
            raise ValueError("the engine's KV cache is NHD")
        it, (hq, hk, d) = case.item, case.heads
        # the copies play the role of layers
        self.attn = SdpaAttention(case.caches, hq, hk, d, it.context)
        pos = it.context - 1  # the new token is the last position: its K/V are already in the cache
        tables = case.block_table.tolist()
        blocks = case.block_table[:, pos // it.page_size].long()
        slots = (blocks * it.page_size + pos % it.page_size).tolist()
        n = it.batch
        self.attn.plan(StepBatch([0] * n, [pos] * n, slots, [1] * n, [it.context] * n, tables))
        off = pos % it.page_size
        self.new_kv = [(c[blocks, 0, off].clone(), c[blocks, 1, off].clone()) for c in case.caches]

    def call(self, i: int) -> None:
        k, v = self.new_kv[i]
        self.outs[i] = self.attn.forward(i, self.case.queries[i], k, v).reshape(self.case.queries[i].shape)


class SdpaDense(Variant):
    name = "sdpa_dense"
    poisonable = False

    def __init__(self, case: Case, ctx: Context) -> None:
        super().__init__(case, ctx)
        self.kv = [tuple(t.contiguous() for t in case.gather_kv(i, slice(None))) for i in range(case.copies)]

    def call(self, i: int) -> None:
        k, v = self.kv[i]
        q = self.case.queries[i][:, :, None, :]  # [B, Hq, 1, D]
        self.outs[i] = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[:, :, 0]


VARIANTS: dict[str, type[Variant]] = {
    v.name: v for v in (FiNative, FiNativeTC, Xqa, XqaShared, XqaWide, XqaOneBlock, SdpaEngine, SdpaDense)
}


def xqa_sub_seqs(sm_count: int, batch: int, kv_heads: int, table_tokens: int) -> int:
    """XQA's split of each sequence (its launcher's rule): min(max(1, SMs // (B * Hk)), ceil(table / 256))."""
    return min(max(1, sm_count // (batch * kv_heads)), -(-table_tokens // XQA_CTA_TOKENS))


# ---------------------------------------------------------------------------------------------------------
# the sweep


@dataclass
class Context:
    args: argparse.Namespace
    device: torch.device
    heads: tuple[int, int, int]
    dtype: torch.dtype
    copy_bytes_per_s: float
    sm_count: int = 0
    flashinfer_error: str | None = None
    native_workspace: Tensor | None = None
    xqa_workspace: Tensor | None = None


def build_grid(args: argparse.Namespace) -> list[Item]:
    """Grid points in priority order (the time budget cuts from the end)."""
    if args.tiny:
        return [Item("core", b, c, 16, "NHD", args.variants or ALL_VARIANTS) for b in (1, 2) for c in (32, 64)]
    quick = args.quick
    batches = args.batches or [1, 4, 16, 64]
    contexts = args.contexts or ([256, 1024, 4096] if quick else [128, 256, 512, 1024, 2048, 4096, 8192])
    pages = args.pages or [16, 32]
    groups: list[tuple[str, list[Item]]] = []

    def grid(group, page, layout, variants, bs=batches, cs=contexts):
        return [Item(group, b, c, page, layout, tuple(variants)) for b in bs for c in cs]

    core = ("fi_native", "xqa_own", "xqa_shared", "sdpa_engine", "sdpa_dense")
    mb_batches = [b for b in (1, 2, 4, 8, 16) if not args.batches or b in args.batches]
    mb_contexts = args.contexts or ([1024, 8192] if quick else [256, 512, 1024, 2048, 4096, 8192])
    extra_contexts = [c for c in contexts if c in (256, 1024, 4096)] or contexts
    if 16 in pages:
        groups.append(("core", grid("core", 16, "NHD", core)))
        groups.append(("multiblock", grid("multiblock", 16, "NHD", ("xqa_own", "xqa_1block"), mb_batches, mb_contexts)))
        extras = ("fi_native", "fi_native_tc", "xqa_own", "xqa_wide")
        groups.append(("extras", grid("extras", 16, "NHD", extras, cs=extra_contexts)))
        groups.append(("layout", grid("layout", 16, "HND", ("fi_native", "xqa_own"))))
    for page in (p for p in pages if p != 16):  # HND at page 32 only on request (--layouts-32 NHD,HND)
        for layout in args.layouts_32:
            groups.append((f"page{page}", grid(f"page{page}", page, layout, ("fi_native", "xqa_own"))))
    items = []
    for name, group in groups:
        if args.groups and name not in args.groups and not any(name.startswith(g) for g in args.groups):
            continue
        for it in group:
            variants = tuple(v for v in it.variants if not args.variants or v in args.variants)
            if variants:
                items.append(Item(it.group, it.batch, it.context, it.page_size, it.layout, variants))
    return items


def copies_for(case_bytes: int, args: argparse.Namespace, device: torch.device) -> int:
    """Distinct cache copies so that one graph replay reads at least --rotate-mb (no L2 hits across calls)."""
    if device.type != "cuda" or args.rotate_mb <= 0:
        return 1
    return int(min(args.max_copies, max(1, math.ceil(args.rotate_mb * 2**20 / case_bytes))))


def measure(name: str, case: Case, ref: Tensor, ctx: Context, native: Variant | None) -> dict:
    """Check, capture, time and re-check one variant on one case; returns its row."""
    it = case.item
    row = {"group": it.group, "variant": name, "batch": it.batch, "context": it.context, "page_size": it.page_size,
           "layout": it.layout, "copies": case.copies}  # fmt: skip
    if name in FLASHINFER_VARIANTS and ctx.flashinfer_error:
        return row | {"status": "skipped", "error": ctx.flashinfer_error}
    var = VARIANTS[name](case, ctx)
    if name == "xqa_shared":
        ws = ctx.native_workspace.view(torch.uint8)[:XQA_SEMAPHORE_BYTES]
        row["shared_ws_nonzero_bytes"] = int(torch.count_nonzero(ws))  # what native left where XQA keeps semaphores
    if var.poisonable:
        var.outs[0].fill_(float("nan"))
    var.call(0)
    sync(case.device)
    row["rel_err_first"] = rel_err(var.outs[0], ref)
    calls = max(case.copies, ctx.args.min_calls)
    order = [i % case.copies for i in range(calls)]

    def run_all():
        for i in order:
            var.call(i)

    if case.device.type == "cuda" and not ctx.args.no_graph:
        t0 = time.perf_counter()
        graph = capture_graph(run_all)
        row["capture_ms"] = (time.perf_counter() - t0) * 1e3
        fn = graph.replay
    else:
        graph, fn = None, run_all
    if var.poisonable:
        var.outs[0].fill_(float("nan"))
    t = time_fn(fn, case.device, repeats=ctx.args.repeats, target_ms=ctx.args.target_ms)
    row["rel_err_last"] = rel_err(var.outs[0], ref)
    if name == "xqa_shared" and native is not None:
        errs = []
        for _ in range(3):  # interleave as a model would when both paths share one workspace
            native.call(0)
            var.outs[0].fill_(float("nan"))
            var.call(0)
            sync(case.device)
            errs.append(rel_err(var.outs[0], ref))
        row["rel_err_after_native"] = max(errs)
    del graph
    us = t["ms"] * 1e3 / calls
    tbps = case.io_bytes / (us * 1e-6) / 1e12
    err = max(v for k, v in row.items() if k.startswith("rel_err"))
    row |= {
        "us_per_call": us,
        "us_min": t["min_ms"] * 1e3 / calls,
        "spread": t["spread"],
        "calls_per_graph": calls,
        "kv_mb": case.kv_bytes / 2**20,
        "tb_per_s": tbps,
        "frac_of_copy": tbps * 1e12 / ctx.copy_bytes_per_s,
        "rel_err": err,
        "status": "ok" if err <= WRONG_REL_ERR else "wrong",
    } | var.info
    return row


def run_item(it: Item, ctx: Context, writer: ResultFile, seed: int) -> None:
    base = {"group": it.group, "batch": it.batch, "context": it.context, "page_size": it.page_size, "layout": it.layout}
    try:
        one = 2 * it.batch * (-(-it.context // it.page_size) * it.page_size) * ctx.heads[1] * ctx.heads[2] * 2
        case = Case(it, ctx.heads, ctx.dtype, ctx.device, copies_for(one, ctx.args, ctx.device)).build(seed)
        ref = case.reference()
    except Exception as exc:  # noqa: BLE001 - record and go on
        for name in it.variants:
            writer.add(base | {"variant": name, "status": "error", "error": f"setup: {error_text(exc)}"})
        free_memory(ctx.device)
        return
    native = None
    for name in it.variants:
        try:
            row = measure(name, case, ref, ctx, native)
            if name == "fi_native" and row.get("status") in ("ok", "wrong"):
                native = FiNative(case, ctx)  # for xqa_shared's interleaved check (same workspace)
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not lose the others
            row = base | {"variant": name, "status": "error", "error": error_text(exc)}
        writer.add(row)
        log(
            f"{it.group:10s} b={it.batch:<3d} ctx={it.context:<5d} page={it.page_size} {it.layout} {name:12s} "
            f"{row.get('us_per_call', float('nan')):8.1f} us  err {row.get('rel_err', float('nan')):.1e}  "
            f"{row.get('status')} {row.get('error', '')}"
        )
    del case, ref, native
    free_memory(ctx.device)


def summarize(rows: list[dict]) -> dict:
    """Time ratios of paired variants (measured on the same data, same grid point), the XQA multi-block
    threshold per batch, and every wrong output."""
    us = {(r["group"], r["variant"], r["batch"], r["context"], r["page_size"], r["layout"]): r["us_per_call"]
          for r in rows if r.get("us_per_call") is not None}  # fmt: skip
    points: dict[str, list[tuple[int, int, float]]] = {}

    def pair(name: str, num: tuple, den: tuple) -> None:
        if num in us and den in us:
            points.setdefault(name, []).append((num[2], num[3], us[num] / us[den]))

    for g, v, b, c, p, lay in list(us):
        if v == "xqa_own":
            pair(f"xqa_own/fi_native page{p} {lay}", (g, v, b, c, p, lay), (g, "fi_native", b, c, p, lay))
        for num, den in (("xqa_shared", "xqa_own"), ("xqa_1block", "xqa_own"), ("xqa_wide", "xqa_own"),
                         ("fi_native_tc", "fi_native")):  # fmt: skip
            if v == num:
                pair(f"{num}/{den}", (g, v, b, c, p, lay), (g, den, b, c, p, lay))
        if v in ("fi_native", "xqa_own") and g == "core":
            pair(f"{v} HND/NHD", ("layout", v, b, c, 16, "HND"), (g, v, b, c, 16, "NHD"))
            pair(f"{v} page32/page16", ("page32", v, b, c, 32, "NHD"), (g, v, b, c, 16, "NHD"))
    ratios = {
        name: {"median": median(r for _, _, r in pts), "min": min(r for _, _, r in pts),
               "max": max(r for _, _, r in pts), "n": len(pts), "points": sorted(pts)}
        for name, pts in sorted(points.items())
    }  # fmt: skip
    threshold = {}
    sub_seqs = {(r["batch"], r["context"]): r.get("xqa_sub_seqs") for r in rows
                if r.get("group") == "multiblock" and r.get("variant") == "xqa_own"}  # fmt: skip
    for b in sorted({b for b, _, _ in points.get("xqa_1block/xqa_own", [])}):
        pts = sorted((c, r) for bb, c, r in points["xqa_1block/xqa_own"] if bb == b)
        gain_from = next((c for c, r in pts if r >= 1.1), None)
        threshold[str(b)] = {"multiblock_10pct_faster_from_context": gain_from,
                             "ratio_1block_over_own": {str(c): r for c, r in pts},
                             "predicted_sub_seqs": {str(c): sub_seqs.get((b, c)) for c, _ in pts}}  # fmt: skip
    wrong = [
        {k: r.get(k) for k in ("group", "variant", "batch", "context", "page_size", "layout", "rel_err")}
        for r in rows
        if r.get("status") == "wrong"
    ]
    return {"ratios": ratios, "multiblock": threshold, "wrong": wrong}


def final_table(rows: list[dict]) -> None:
    """One table: the core grid (page 16, NHD) side by side, plus the multi-block and ratio summary lines."""
    by = {(r["variant"], r["batch"], r["context"], r["page_size"], r["layout"]): r for r in rows if r.get("variant")}
    page = 16
    shapes = sorted({(r["batch"], r["context"]) for r in rows if r.get("page_size") == page and r["layout"] == "NHD"})
    table = []
    for b, c in shapes:

        def us(var, layout="NHD", b=b, c=c):
            r = by.get((var, b, c, page, layout))
            return r.get("us_per_call") if r else None

        def err(var, b=b, c=c):
            r = by.get((var, b, c, page, "NHD"))
            return r.get("rel_err") if r else None

        nat, xqa = us("fi_native"), us("xqa_own")
        errs = [e for e in (err("fi_native"), err("xqa_own"), err("xqa_shared")) if e is not None]
        table.append({
            "batch": b, "context": c, "native_us": nat, "xqa_us": xqa,
            "xqa/native": xqa / nat if nat and xqa else None,
            "xqa_shared_us": us("xqa_shared"), "xqa_1block_us": us("xqa_1block"),
            "native_HND_us": us("fi_native", "HND"), "xqa_HND_us": us("xqa_own", "HND"),
            "sdpa_us": us("sdpa_engine"), "sdpa_dense_us": us("sdpa_dense"),
            "max_rel_err": max(errs) if errs else err("sdpa_engine"), "shared_err": err("xqa_shared"),
        })  # fmt: skip
    print_table(table, list(table[0].keys()) if table else ["batch"], title=f"\nattention per call, page {page}")
    s = summarize(rows)
    print("time ratios of paired variants (same data, same grid point):")
    for k, v in s["ratios"].items():
        print(f"  {k:32s} median {v['median']:.2f}  (min {v['min']:.2f}, max {v['max']:.2f}, n={v['n']})")
    for b, v in s["multiblock"].items():
        print(f"  XQA batch {b}: multi-block >=10% faster from context {v['multiblock_10pct_faster_from_context']}"
              f" (sub-sequences per context: {v['predicted_sub_seqs']})")  # fmt: skip
    print(
        f"  wrong outputs (rel. err > {WRONG_REL_ERR}): {len(s['wrong'])}"
        + (f" {s['wrong'][:6]}" if s["wrong"] else "")
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny heads (4/2, d=32) and sizes; SDPA only on CPU")
    p.add_argument("--quick", action="store_true", help="contexts 256/1024/4096 and a smaller extension grid")
    p.add_argument("--batches", type=ints_arg, default=None)
    p.add_argument("--contexts", type=ints_arg, default=None)
    p.add_argument("--pages", type=ints_arg, default=None, help="page sizes (default 16,32)")
    p.add_argument("--layouts-32", type=strs_arg, default=["NHD"], help="layouts timed at page sizes other than 16")
    p.add_argument("--variants", type=strs_arg, default=None, help=f"subset of {','.join(ALL_VARIANTS)}")
    p.add_argument("--groups", type=strs_arg, default=None, help="core,layout,page32,multiblock,extras")
    p.add_argument("--wide-len", type=int, default=32768, help="max_model_len the xqa_wide block table is sized for")
    p.add_argument("--rotate-mb", type=float, default=256.0, help="min MB of KV one graph replay cycles through")
    p.add_argument("--max-copies", type=int, default=256)
    p.add_argument("--min-calls", type=int, default=4, help="calls per captured graph at least")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--target-ms", type=float, default=4.0, help="length of one timed repeat")
    p.add_argument("--budget-s", type=float, default=230.0, help="stop starting new grid points after this")
    p.add_argument("--no-graph", action="store_true", help="time eager calls instead of graph replays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results)")
    args = p.parse_args(argv)
    bad = [v for v in args.variants or () if v not in ALL_VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {list(ALL_VARIANTS)}")
    return args


def main(argv: Sequence[str] | None = None) -> ResultFile:
    args = parse_args(argv)
    device = resolve_device(args.device)
    t_start = time.perf_counter()
    heads = TINY_HEADS if args.tiny else HIGGS_HEADS
    meta = environment(device, "bench_attention.py", argv)
    bw = copy_bandwidth(device)
    ctx = Context(args, device, heads, torch.bfloat16, bw["bytes_per_s"])
    meta |= {"copy_tb_per_s": bw["tb_per_s"], "heads": {"q": heads[0], "kv": heads[1], "head_dim": heads[2]},
             "dtype": "bfloat16", "rotate_mb": args.rotate_mb, "graphs": device.type == "cuda" and not args.no_graph,
             "wrong_rel_err": WRONG_REL_ERR}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        ctx.sm_count = props.multi_processor_count
        meta["sm_count"] = ctx.sm_count
        meta["l2_mb"] = getattr(props, "L2_cache_size", 0) / 2**20
        try:
            import flashinfer  # noqa: F401

            ctx.native_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            ctx.xqa_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        except Exception as exc:  # noqa: BLE001
            ctx.flashinfer_error = f"flashinfer unavailable: {error_text(exc)}"
    else:
        ctx.flashinfer_error = "FlashInfer needs a CUDA device"
    writer = ResultFile(args.out, "attention", meta, smoke=args.tiny)
    log(f"copy ceiling {bw['tb_per_s']:.2f} TB/s; writing {writer.path}")
    items = build_grid(args)
    for n, it in enumerate(items):
        if time.perf_counter() - t_start > args.budget_s:
            for rest in items[n:]:
                for name in rest.variants:
                    writer.add({"group": rest.group, "variant": name, "batch": rest.batch, "context": rest.context,
                                "page_size": rest.page_size, "layout": rest.layout, "status": "skipped",
                                "error": f"time budget {args.budget_s:.0f} s"})  # fmt: skip
            log(f"time budget reached: {len(items) - n} grid points skipped")
            break
        run_item(it, ctx, writer, args.seed + n)
    writer.meta["wall_s"] = time.perf_counter() - t_start
    writer.set("summary", summarize(writer.rows))
    final_table(writer.rows)
    print(f"\nwrote {writer.path} ({writer.meta['wall_s']:.0f} s)")
    return writer


if __name__ == "__main__":
    main()
