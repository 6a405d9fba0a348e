"""Kernel choice by measurement: per graph bucket, the fastest correct decode kernel of the attention backend; per
linear, whether inputs of one row, and of a few rows, take our Triton kernels (``choose_row_linears``, at the end).

Each candidate in ``backend.decode_kernels`` first runs alone through the backend's own bucket path
(``plan_bucket`` + ``forward``) on a fork of the backend over synthetic caches, timed inside a CUDA graph and
checked against an fp32 reference; a kernel that raises or misses the tolerance is never chosen. The KV comes
from HBM, not L2: the fork has enough layers (distinct caches) to exceed the L2 several times.

Alone is not how a kernel runs, though: in a step each attention call sits between weight-streaming GEMMs, and
on the H200 that costs XQA 9-22 us a layer more than alone (XQA, the fastest alone at batch 64, made the whole
step 10% slower than ``native_tc``). So where the caller gives a
``step`` (the graph runner gives the model's whole decode step), the correct kernels are timed inside it: one
CUDA graph of the whole step per (bucket, context, kernel), on the engine's own caches before any request
exists, and the choice goes by that time.

A choice read from the choice cache (``choice_cache.py``) is not timed again but checked as a candidate is:
``check_decode_kernels`` and ``check_row_linears`` run the same error checks on the cached kernel or tile alone,
and name those that fail, for the graph runner to measure again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from ..batch import StepBatch
from ..kv_cache import kv_slot
from .capture import capture_graph, median_ms

if TYPE_CHECKING:
    from ..attention import AttentionBackend

logger = logging.getLogger(__name__)

L2_DEFEAT_BYTES = 256 * 1024 * 1024  # several times the H200's 50 MB L2
MAX_LAYERS = 36
# (a decode batch of synthetic requests, planned) -> a function that runs the whole step once, graph-safe
StepFactory = Callable[[StepBatch], Callable[[], object]]


def synthetic_batch(batch: int, ctx: int, block_size: int, num_blocks: int | None = None) -> StepBatch:
    """``batch`` requests of context ``ctx`` in consecutive blocks, each decoding its last position (all on
    decode-state slot 0). With ``num_blocks`` the block ids wrap around a pool of that many blocks (requests then
    share blocks, and their K/V writes land in them)."""
    per_seq = -(-ctx // block_size)
    wrap = num_blocks or batch * per_seq
    tables = [[b % wrap for b in range(i * per_seq, (i + 1) * per_seq)] for i in range(batch)]
    pos = ctx - 1
    return StepBatch(
        slots=[0] * batch,
        positions=[pos] * batch,
        slot_mapping=[kv_slot(t, pos, block_size) for t in tables],
        query_lens=[1] * batch,
        seq_lens=[ctx] * batch,
        block_tables=tables,
    )


def _reference(cache: Tensor, q: Tensor, batch: StepBatch, scale: float) -> Tensor:
    """fp32 decode attention of ``batch`` over ``cache`` [blocks, 2, bs, Hk, D] -> [B, Hq * D]."""
    hk, d = cache.shape[3], cache.shape[4]
    kv = cache[torch.tensor(batch.block_tables, device=cache.device)].float()  # [B, nb, 2, bs, Hk, D]
    ctx = batch.seq_lens[0]
    k = kv[:, :, 0].reshape(q.shape[0], -1, hk, d)[:, :ctx].transpose(1, 2)
    v = kv[:, :, 1].reshape(q.shape[0], -1, hk, d)[:, :ctx].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.float()[:, :, None], k, v, scale=scale, enable_gqa=True)
    return out.reshape(q.shape[0], -1)


def _measure(
    attn: AttentionBackend, size: int, ctx: int, kernel: str, gen: torch.Generator, timed: bool = True
) -> tuple[float, float]:
    """(microseconds per call inside a CUDA graph, relative error vs fp32) of one kernel at one point; with
    ``timed=False`` only the error (one layer, no graph; the time is NaN)."""
    ref_cache = attn.kv_caches[0]
    dev, dtype, bs = ref_cache.device, ref_cache.dtype, ref_cache.shape[2]
    hk, d = ref_cache.shape[3], ref_cache.shape[4]
    batch = synthetic_batch(size, ctx, bs)
    shape = (size * -(-ctx // bs) + 1, 2, bs, hk, d)  # + the fork's scratch block
    nbytes = torch.Size(shape).numel() * ref_cache.element_size()
    layers = max(1, min(MAX_LAYERS, -(-L2_DEFEAT_BYTES // nbytes))) if timed else 1
    caches = [torch.randn(shape, generator=gen, device=dev).to(dtype) for _ in range(layers)]
    fork = attn.fork(caches)
    fork.set_bucket_kernel(size, kernel)
    fork.plan_bucket(batch)
    q = torch.randn(size, fork.num_heads, d, generator=gen, device=dev).to(dtype)
    k = torch.randn(size, hk, d, generator=gen, device=dev).to(dtype)
    v = torch.randn(size, hk, d, generator=gen, device=dev).to(dtype)

    def all_layers() -> None:
        for layer in range(layers):
            fork.forward(layer, q, k, v)

    us = float("nan")
    if timed:
        graph, _ = capture_graph(all_layers)
        us = median_ms(lambda: [graph.replay() for _ in range(20)], iters=3) * 1e3 / (20 * layers)
    got = fork.forward(0, q, k, v)  # the new K/V are in the cache by now: the reference reads them
    want = _reference(caches[0], q, batch, fork.scale)
    return us, ((got.float() - want).norm() / want.norm()).item()


def step_context(attn: AttentionBackend, size: int, ctx: int) -> int:
    """The context the whole-step timing uses for ``size`` requests: ``ctx``, or less where the KV pool cannot give
    each request blocks of its own (requests sharing blocks read them from L2, which favours some kernels: at 64
    requests of 2,048 tokens on a smaller pool FlashInfer's kernel looked 9 % faster than ours, and was 5 % slower
    in real steps; H100, results/h100_20261206e)."""
    block_size = attn.kv_caches[0].shape[2]
    return max(1, min(ctx, attn.scratch_block // size * block_size))


def _step_ms(attn: AttentionBackend, step: StepFactory, size: int, ctx: int, kernel: str) -> float:
    """Milliseconds of one replay of the whole decode step with this kernel (a CUDA graph of ``step``) at context
    ``step_context(attn, size, ctx)``."""
    block_size = attn.kv_caches[0].shape[2]
    ctx = step_context(attn, size, ctx)
    batch = synthetic_batch(size, ctx, block_size, num_blocks=attn.scratch_block)
    attn.set_bucket_kernel(size, kernel)
    attn.plan_bucket(batch)
    graph, _ = capture_graph(step(batch))
    return median_ms(lambda: [graph.replay() for _ in range(3)], iters=3) / 3


def pick_kernels(rows: list[dict], kernels: tuple[str, ...], key: str) -> dict[int, str]:
    """Per bucket, the kernel with the least ``key`` summed over contexts among those that were ``ok`` at every
    context (ties: the earlier kernel in ``kernels``); a bucket where none was ok gets the first kernel."""
    totals: dict[tuple[int, str], float] = {}
    for r in rows:
        value = r.get(key, float("inf")) if r["ok"] else float("inf")
        totals[r["bucket"], r["kernel"]] = totals.get((r["bucket"], r["kernel"]), 0.0) + value
    buckets = sorted({b for b, _ in totals})
    return {b: min(kernels, key=lambda k, b=b: (totals.get((b, k), float("inf")), kernels.index(k))) for b in buckets}


def choose_decode_kernels(
    attn: AttentionBackend,
    buckets: list[int],
    contexts: tuple[int, ...] = (512, 2048),
    tolerance: float = 2e-2,
    step: StepFactory | None = None,
) -> list[dict]:
    """Give every bucket the faster correct kernel (summed over ``contexts``), via ``attn.set_bucket_kernel``.

    With one candidate there is nothing to measure. A kernel that raises or misses ``tolerance`` alone is never
    chosen. With ``step`` the others are timed inside the whole decode step (``step_ms``) and chosen by that,
    else by their time alone (``us``). ``step(batch)`` gets a planned batch of synthetic requests on the
    backend's own caches (block ids wrap around its pool) and returns a graph-safe function running the step.
    Returns the measurement table (one dict per bucket x context x kernel).
    """
    kernels = tuple(attn.decode_kernels)
    if len(kernels) == 1:
        for b in buckets:
            attn.set_bucket_kernel(b, kernels[0])
        return []
    gen = torch.Generator(device=attn.kv_caches[0].device).manual_seed(0)
    rows = []
    for ctx in sorted({min(c, attn.max_model_len) for c in contexts}):
        for b in buckets:
            for kernel in kernels:
                row = {"bucket": b, "context": ctx, "kernel": kernel}
                try:
                    row["us"], row["rel_err"] = _measure(attn, b, ctx, kernel, gen)
                    row["ok"] = row["rel_err"] <= tolerance
                    if row["ok"] and step is not None:
                        row["step_ms"] = _step_ms(attn, step, b, ctx, kernel)
                        row["step_context"] = step_context(attn, b, ctx)
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is simply not chosen
                    logger.warning("decode kernel %s failed at batch %d, context %d: %s", kernel, b, ctx, exc)
                    row.update(us=float("inf"), rel_err=float("nan"), ok=False)
                rows.append(row)
    chosen = pick_kernels(rows, kernels, "step_ms" if step is not None else "us")
    for b, kernel in chosen.items():
        attn.set_bucket_kernel(b, kernel)
    lines = [
        f"  batch {r['bucket']:>3} ctx {r['context']:>5} {r['kernel']:>17}: alone {r['us']:8.1f} us"
        + (f", step {r['step_ms']:.3f} ms (context {r['step_context']})" if "step_ms" in r else "")
        + f"  err {r['rel_err']:.1e}{'' if r['ok'] else '  (rejected)'}"
        for r in rows
    ]
    summary = ", ".join(f"{b}:{k}" for b, k in chosen.items())
    logger.info("decode kernels (CUDA graphs):\n%s\nchosen per bucket: %s", "\n".join(lines), summary)
    return rows


def check_decode_kernels(
    attn: AttentionBackend,
    chosen: dict[int, str | None],
    contexts: tuple[int, ...] = (512, 2048),
    tolerance: float = 2e-2,
) -> tuple[list[dict], list[int]]:
    """Check each bucket's given kernel (a cached choice) as ``choose_decode_kernels`` checks a candidate (alone,
    against fp32, at every context), without timing it; give the bucket that kernel where it passes.

    Returns (the table, the buckets whose kernel failed: not allowed here, raised, or missed ``tolerance``).
    """
    gen = torch.Generator(device=attn.kv_caches[0].device).manual_seed(0)
    rows, failed = [], []
    for b, kernel in chosen.items():
        ok = kernel in attn.decode_kernels
        for ctx in sorted({min(c, attn.max_model_len) for c in contexts}) if ok else ():
            row = {"bucket": b, "context": ctx, "kernel": kernel, "cached": True}
            try:
                _, row["rel_err"] = _measure(attn, b, ctx, kernel, gen, timed=False)
                row["ok"] = row["rel_err"] <= tolerance
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot run fails its check
                logger.info("cached decode kernel %s failed at batch %d, context %d: %s", kernel, b, ctx, exc)
                row.update(rel_err=float("nan"), ok=False)
            rows.append(row)
            ok = ok and row["ok"]
        if ok:
            attn.set_bucket_kernel(b, kernel)
        else:
            failed.append(b)
    return rows, failed


# the model's linears a one-row GEMV can take: name (as the model passes it to ``kernels.linear``) -> the module
ROW_LINEARS = {
    "qkv": lambda layer: layer.self_attn.qkv_proj,
    "o_proj": lambda layer: layer.self_attn.o_proj,
    "gate_up": lambda layer: layer.mlp.gate_up_proj,
    "down": lambda layer: layer.mlp.down_proj,
}


def row_gemv_option(kernels, layers: Sequence) -> str:
    """The ``row_gemv`` option of ``kernels`` (a model's kernels object) where the one-row GEMV can run on
    ``layers``' weights (bf16 / fp16), else off."""
    option = getattr(kernels, "row_gemv", "off")
    dtype = ROW_LINEARS["qkv"](layers[0]).weight.dtype
    return option if dtype in (torch.bfloat16, torch.float16) else "off"


def _row_kernel(few: bool) -> tuple:
    """(tiles, kernel, rows of the input it is measured on) of the one-row GEMV (``few`` False) or of the few-row
    kernel (True)."""
    from .. import triton_gemv as gemv

    if few:
        return gemv.FEW_ROW_CONFIGS, gemv.few_rows_linear, gemv.FEW_ROWS
    return gemv.CONFIGS, gemv.row_linear, 1


def row_table(kernels, few: bool) -> dict:
    """The kernels' table (linear name -> tile) of the one-row GEMV, or with ``few`` of the few-row kernel."""
    return kernels.few_row_configs if few else kernels.row_configs


def row_tile_candidates(kernels, layers: Sequence) -> dict | None:
    """The tiles warm-up tries for the one-row and the few-row kernel (part of the choice cache's key: a choice
    is among them); None where the ``row_gemv`` option is off (``row_gemv_option``)."""
    if row_gemv_option(kernels, layers) == "off":
        return None
    return {"one": [list(c) for c in _row_kernel(False)[0]], "few": [list(c) for c in _row_kernel(True)[0]]}


def choose_row_linears(
    kernels, layers: Sequence, names: list[str] | None = None, few: bool = False, silu_gate_up: bool = True
) -> list[dict]:
    """Give each linear of ``layers`` (or of ``names``) our Triton kernel for one-row inputs (``triton_gemv
    .row_linear``; with ``few``, the kernel for 2 to ``FEW_ROWS`` rows, ``few_rows_linear``) via ``kernels``'
    ``row_configs`` (``few_row_configs``) as their ``row_gemv`` option says: ``auto`` where it is correct
    and faster than the kernels' own path, ``on`` wherever it is correct (the first correct tile), ``off``
    nowhere. A linear left out stays on cuBLAS. gate_up is measured with SiLU-and-mul after it (``silu_gate_up``)
    or, for a model that runs the activation apart, without.

    Each tile is checked first, on layer 0 with random rows (one, or ``FEW_ROWS``), against a float64 product:
    one that raises or misses the dtype's epsilon (relative norm) is never chosen. Under ``auto`` the product of
    the rows with every layer's weight (so weights stream from HBM as in a step; gate_up with SiLU-and-mul after
    it) is timed in a CUDA graph for the kernels' path and each correct tile. Returns the table (one dict per
    linear).
    """
    layers = list(layers)
    option = row_gemv_option(kernels, layers)
    if option == "off":
        return []
    configs, kernel, n_rows = _row_kernel(few)
    label = f"{n_rows}-row linear" if few else "one-row GEMV"
    table = row_table(kernels, few)
    names = list(ROW_LINEARS) if names is None else names
    for name in names:
        table.pop(name, None)
    weight = ROW_LINEARS["qkv"](layers[0]).weight
    gen = torch.Generator(device=weight.device).manual_seed(0)
    rows = []
    for name in names:
        modules = [ROW_LINEARS[name](layer) for layer in layers]
        silu = silu_gate_up and name == "gate_up"
        x = _random_rows(n_rows, modules[0], gen)
        row = {"linear": name, "rows": n_rows}
        if option == "auto":
            try:
                row["torch_us"] = _products_us(_kernels_product(kernels, name, x, silu), modules)
            except Exception as exc:  # noqa: BLE001 - nothing to compare against: the linear stays as it is
                logger.warning("%s: timing %s's own path failed (%s); %s stays on it", label, name, exc, name)
                row["chosen"] = "torch"
                rows.append(row)
                continue
        want = _row_reference(x, modules[0], silu)  # once per linear: every tile is compared with it
        best = None
        for config in configs:
            tile = str(tuple(config))
            try:
                row[f"err{tile}"] = err = _tile_error(kernel, x, modules[0], config, silu, want)
                if not _tile_ok(err, weight.dtype):
                    logger.warning("%s %s off by %.1e on %s: not used", label, tile, err, name)
                    continue
                if option == "on":
                    best = (0.0, config)
                    break
                row[f"us{tile}"] = us = _products_us(_row_product(kernel, x, config, silu), modules)
            except Exception as exc:  # noqa: BLE001 - a tile that cannot run is simply not chosen
                # gate_up's few-row tiles hold two weight tiles: the largest needs more shared memory than a Hopper
                # SM has (240 KiB of 227), an expected outcome of the search, so it is logged below the warnings
                level = logging.INFO if type(exc).__name__ == "OutOfResources" else logging.WARNING
                logger.log(level, "%s %s failed on %s: %s", label, tile, name, exc)
                row[f"failed{tile}"] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            if best is None or us < best[0]:
                best = (us, config)
        if best is not None and (option == "on" or best[0] < row["torch_us"]):
            table[name] = best[1]
        row["chosen"] = str(tuple(table[name])) if name in table else "torch"
        rows.append(row)
    logger.info("%ss (%s): %s", label, option, "; ".join(
        f"{r['linear']} -> {r['chosen']}" + (f" (torch {r['torch_us']:.1f} us, best triton "
        f"{min((v for k, v in r.items() if k.startswith('us(')), default=float('nan')):.1f} us a layer)"
        if "torch_us" in r else "") for r in rows))  # fmt: skip
    return rows


def check_row_linears(
    kernels, layers: Sequence, tiles: dict[str, tuple], few: bool = False
) -> tuple[list[dict], list[str]]:
    """Check each linear's given tile (a cached choice) of the one-row kernel (with ``few``, of the few-row
    kernel) as ``choose_row_linears`` checks a candidate (layer 0, random rows, against float64), without timing
    it; the linears whose tile passes take it, every other linear stays on the kernels' own path for those rows.
    Returns (the table, the linears whose tile failed: unknown, raised, or off)."""
    from ..triton_gemv import RowConfig

    configs, kernel, n_rows = _row_kernel(few)
    table = row_table(kernels, few)
    table.clear()
    layer0 = layers[0]
    gen = torch.Generator(device=ROW_LINEARS["qkv"](layer0).weight.device).manual_seed(0)
    rows, failed = [], []
    for name, tile in tiles.items():
        row = {"linear": name, "rows": n_rows, "chosen": str(tuple(tile)), "cached": True}
        rows.append(row)
        config = RowConfig(*tile) if len(tile) == len(RowConfig._fields) else None
        if name not in ROW_LINEARS or config not in configs:
            failed.append(name)
            continue
        module = ROW_LINEARS[name](layer0)
        x = _random_rows(n_rows, module, gen)
        try:
            silu = name == "gate_up"
            want = _row_reference(x, module, silu)
            row[f"err{tuple(config)}"] = err = _tile_error(kernel, x, module, config, silu, want)
        except Exception as exc:  # noqa: BLE001 - a tile that cannot run fails its check
            logger.info("cached %s-row tile %s failed on %s: %s", n_rows, tuple(config), name, exc)
            err = float("nan")
        if _tile_ok(err, module.weight.dtype):
            table[name] = config
        else:
            failed.append(name)
    return rows, failed


def _random_rows(n_rows: int, module, gen: torch.Generator) -> Tensor:
    """``n_rows`` random input rows for ``module`` (its weight [N, K]: K columns, its device and dtype), the rows a
    tile is checked and timed on."""
    weight = module.weight
    return torch.randn(n_rows, weight.shape[1], generator=gen, device=weight.device).to(weight.dtype)


def _tile_error(kernel, x: Tensor, module: torch.nn.Module, config, silu: bool, want: Tensor) -> float:
    """Relative error (norm) of ``kernel`` (one of ``triton_gemv``'s) with tile ``config`` on rows ``x`` against
    ``want``, the float64 product (``_row_reference``)."""
    got = kernel(x, module.weight, module.bias, config, silu_mul=silu)
    return ((got.double() - want).norm() / want.norm()).item()


def _tile_ok(err: float, dtype: torch.dtype) -> bool:
    return err <= torch.finfo(dtype).eps  # False for NaN


def _kernels_product(kernels, name: str, x: Tensor, silu: bool) -> Callable[[torch.nn.Module], Tensor]:
    """The kernels' own path for linear ``name`` on rows ``x`` (with ``silu``: gate_up with SiLU-and-mul), per
    module."""
    if silu:
        return lambda module: kernels.gate_up_silu(x, module)
    return lambda module: kernels.linear(name, x, module)


def _row_product(kernel, x: Tensor, config, silu: bool) -> Callable[[torch.nn.Module], Tensor]:
    """``kernel`` (one of ``triton_gemv``'s) with tile ``config`` on rows ``x``, per module."""
    return lambda module: kernel(x, module.weight, module.bias, config, silu_mul=silu)


def _products_us(product: Callable[[torch.nn.Module], Tensor], modules: list[torch.nn.Module]) -> float:
    """Microseconds per module of ``product`` over every module, replayed in one CUDA graph."""
    graph, _ = capture_graph(lambda: [product(m) for m in modules])
    return median_ms(lambda: [graph.replay() for _ in range(5)], iters=5) * 1e3 / (5 * len(modules))


def _row_reference(x: Tensor, module: torch.nn.Module, silu: bool) -> Tensor:
    """float64 ``module(x)`` (for gate_up: SiLU-and-mul of its two halves, each rounded as the GEMM stores it)."""
    y = x.double() @ module.weight.double().T
    if module.bias is not None:
        y = y + module.bias.double()
    if not silu:
        return y
    gate, up = y.to(x.dtype).double().chunk(2, dim=-1)
    return F.silu(gate) * up
