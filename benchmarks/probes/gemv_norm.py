"""Would one-row Triton GEMVs with the layer's norms, residual adds and SiLU-and-mul folded in beat cuBLAS and
FlashInfer's small kernels at batch 1?

At batch 1 a decode step is latency-bound kernel by kernel. Per layer today (H200,
``results/h200_20261202b/profile_step_full_fused_20261202-0431.log``): add+RMSNorm 2.7 + qkv 10.9; o_proj 7.9 +
split-K reduce 1.9 + add+RMSNorm 2.7; SiLU-and-mul 2.4 + down 15.0 + reduce 1.9 (gate_up, 29 us, stays cuBLAS).
One Triton kernel (``_row_kernel``) with four switches covers each group:

- ``NORM_IN``: the input row is the residual; every program computes its RMS itself (the row is 2560 values,
  read from L2) and multiplies the normalised, bf16-rounded row: input_layernorm folded into qkv.
- ``SILU``: the input is gate | up; SiLU-and-mul while loading, rounded as FlashInfer's kernel stores it.
- ``ADD``: the output is added to the residual (in place) and the fp32 sum kept for the norm that follows.
- ``NORM_OUT``: the last program to finish (a ticket from an atomic counter) sums every program's partial sum of
  squares in program order (deterministic), normalises the row and resets the counter.

Two ways to cover a layer: A = qkv(NORM_IN) + o_proj(ADD, NORM_OUT) + down(SILU, ADD): no separate norm at all;
B = cuBLAS qkv + o_proj(ADD, NORM_OUT) + down(SILU, ADD, NORM_OUT). Each variant's output (and residual) is
checked against a float64 recomputation with the unfused path's roundings before it is timed.

CUDA only (the kernel also runs under ``TRITON_INTERPRET=1`` on CPU where triton is installed: ``--check-only
--device cpu``, tiny shapes).
36 weight copies per graph, so weights stream from HBM as in a step; several tile configurations per shape.

    python benchmarks/probes/gemv_norm.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from optional_triton import jit, require_triton, tl, triton

EPS = 1e-6
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the 2026-12-01 GEMV probe's best one-row tiles, and neighbours
CONFIGS = [(2, 1024, 4, 2), (4, 512, 4, 3), (8, 512, 4, 3), (2, 512, 4, 3), (4, 1024, 4, 2), (1, 2048, 4, 2),
           (8, 256, 4, 4), (4, 256, 2, 4)]  # fmt: skip


@jit
def _row_kernel(
    x_ptr, w_ptr, y_ptr, norm_in_ptr, res_ptr, h_ptr, norm_out_ptr, out_ptr, partial_ptr, counter_ptr, N, K, eps,
    NORM_IN: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr, NORM_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FINAL_BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rstd_in = 1.0
    if NORM_IN:  # the input row's RMS, computed by every program (K values, from L2 after the first)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + cols, mask=cols < K, other=0).to(tl.float32)
            sq += xk * xk
        rstd_in = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        if SILU:  # x is gate | up [2K]
            g = tl.load(x_ptr + cols, mask=col_ok, other=0).to(tl.float32)
            u = tl.load(x_ptr + K + cols, mask=col_ok, other=0).to(tl.float32)
            xk = (g / (1.0 + tl.exp(-g)) * u).to(w_ptr.dtype.element_ty).to(tl.float32)
        elif NORM_IN:
            xk = tl.load(x_ptr + cols, mask=col_ok, other=0).to(tl.float32)
            nw = tl.load(norm_in_ptr + cols, mask=col_ok, other=0).to(tl.float32)
            xk = (xk * rstd_in * nw).to(w_ptr.dtype.element_ty).to(tl.float32)
        else:
            xk = tl.load(x_ptr + cols, mask=col_ok, other=0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0)  # fmt: skip
        acc += w.to(tl.float32) * xk[None, :]
    y = tl.sum(acc, axis=1)
    if ADD:
        h = y.to(res_ptr.dtype.element_ty).to(tl.float32) + tl.load(res_ptr + rows, mask=row_ok, other=0).to(
            tl.float32
        )  # the GEMV's output rounded (as cuBLAS stores it), plus the residual
        tl.store(res_ptr + rows, h.to(res_ptr.dtype.element_ty), mask=row_ok)  # the new residual (in place)
        tl.store(h_ptr + rows, h, mask=row_ok)  # fp32 sum: the norm that follows reads it
        if NORM_OUT:
            tl.store(partial_ptr + pid, tl.sum(tl.where(row_ok, h * h, 0.0), axis=0))
            tl.debug_barrier()  # every thread's stores before the ticket (the atomic releases them at GPU scope)
            ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
            if ticket == programs - 1:  # the last program: every other program's rows and partial are visible
                tl.debug_barrier()
                total = tl.zeros([FINAL_BLOCK], dtype=tl.float32)
                for p0 in range(0, programs, FINAL_BLOCK):
                    p = p0 + tl.arange(0, FINAL_BLOCK)
                    total += tl.load(partial_ptr + p, mask=p < programs, other=0.0, cache_modifier=".cg")
                rstd = tl.rsqrt(tl.sum(total, axis=0) / N + eps)
                for n0 in range(0, N, FINAL_BLOCK):
                    n = n0 + tl.arange(0, FINAL_BLOCK)
                    hn = tl.load(h_ptr + n, mask=n < N, other=0.0, cache_modifier=".cg")
                    wn = tl.load(norm_out_ptr + n, mask=n < N, other=0).to(tl.float32)
                    tl.store(out_ptr + n, (hn * rstd * wn).to(out_ptr.dtype.element_ty), mask=n < N)
                tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch (stream order)
    else:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


class RowOp:
    """One launch of ``_row_kernel`` for an [N, K] weight with fixed switches and tile."""

    def __init__(self, n, k, config, device, norm_in=False, silu=False, add=False, norm_out=False) -> None:
        self.n, self.k = n, k
        self.flags = dict(NORM_IN=norm_in, SILU=silu, ADD=add, NORM_OUT=norm_out)
        self.block_n, self.block_k, self.warps, self.stages = config
        self.programs = triton.cdiv(n, self.block_n)
        self.partial = torch.zeros(self.programs, dtype=torch.float32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.h = torch.empty(n, dtype=torch.float32, device=device)
        self.out = torch.empty(n, dtype=torch.bfloat16, device=device)

    def __call__(self, x, w, res=None, norm_in=None, norm_out=None):
        dummy = self.out
        _row_kernel[(self.programs,)](
            x, w, self.out, norm_in if norm_in is not None else dummy, res if res is not None else dummy, self.h,
            norm_out if norm_out is not None else dummy, self.out, self.partial, self.counter, self.n, self.k, EPS,
            **self.flags, BLOCK_N=self.block_n, BLOCK_K=self.block_k, FINAL_BLOCK=1024,
            num_warps=self.warps, num_stages=self.stages,
        )  # fmt: skip
        return self.out


# the groups a layer could run as one kernel: name -> (linear, switches)
GROUPS = {
    "qkv+norm_in": ("qkv", dict(norm_in=True)),
    "o+add+norm": ("o_proj", dict(add=True, norm_out=True)),
    "silu+down+add": ("down", dict(silu=True, add=True)),
    "silu+down+add+norm": ("down", dict(silu=True, add=True, norm_out=True)),
    "qkv": ("qkv", {}),
    "o": ("o_proj", {}),
    "down": ("down", {}),
}


def reference(group: str, x, w, res, norm_w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float64 recomputation with the unfused path's roundings -> (output fp64, new residual bf16 or None)."""
    flags = GROUPS[group][1]
    xd = x.double().flatten()
    if flags.get("silu"):
        g, u = xd.chunk(2)
        xd = (F.silu(g) * u).to(x.dtype).double()
    if flags.get("norm_in"):  # FlashInfer's RMSNorm: fp32 statistics, bf16(x * rstd * w)
        xd = (xd * torch.rsqrt(xd.pow(2).mean() + EPS) * norm_w.double()).to(x.dtype).double()
    y = w.double() @ xd
    if not flags.get("add"):
        return y, None
    h = y.to(res.dtype).double() + res.double()  # the GEMV's bf16 output + the residual
    if not flags.get("norm_out"):
        return h, h.to(res.dtype)
    return h * torch.rsqrt(h.pow(2).mean() + EPS) * norm_w.double(), h.to(res.dtype)


def baseline(group: str, x, w, res, norm_w, timing: bool = False) -> torch.Tensor:
    """What a layer runs today for the group: FlashInfer's norms and SiLU-and-mul, cuBLAS (torch where FlashInfer
    is absent). ``res`` is updated in place where the group adds; with ``timing``, an add without a norm after
    it is left out (today it happens in the next group's fused add+RMSNorm)."""
    flags = GROUPS[group][1]
    try:
        import flashinfer

        if flags.get("silu"):
            x = flashinfer.activation.silu_and_mul(x)
        if flags.get("norm_in") and timing:  # the add of the previous group's output happens here today
            flashinfer.norm.fused_add_rmsnorm(x, res, norm_w, EPS)
        elif flags.get("norm_in"):
            x = flashinfer.norm.rmsnorm(x, norm_w, EPS)
        y = F.linear(x, w)
        if flags.get("norm_out"):
            flashinfer.norm.fused_add_rmsnorm(y, res, norm_w, EPS)
        elif flags.get("add") and not timing:
            res.add_(y)
            return res
        return y
    except ImportError:
        if flags.get("silu"):
            g, u = x.chunk(2, dim=-1)
            x = (F.silu(g.float()) * u.float()).to(x.dtype)
        if flags.get("norm_in"):
            x = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS) * norm_w.float()).to(x.dtype)
        y = F.linear(x, w)
        if flags.get("add"):
            h = y.float() + res.float()
            res.copy_(h.to(res.dtype))
            if flags.get("norm_out"):
                return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.float()).to(res.dtype)
            return h
        return y


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return ((a - b).norm() / b.norm()).item()


def inputs(group, n, k, device, gen):
    flags = GROUPS[group][1]
    x = torch.randn(1, 2 * k if flags.get("silu") else k, generator=gen, device=device).bfloat16()
    w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).bfloat16()
    res = torch.randn(1, k if flags.get("norm_in") else n, generator=gen, device=device).bfloat16()  # norm_in: x's
    norm_w = (1 + 0.1 * torch.randn(k if flags.get("norm_in") else n, generator=gen, device=device)).bfloat16()
    return x, w, res, norm_w


def run_fused(op: RowOp, group, x, w, res, norm_w):
    flags = GROUPS[group][1]
    return op(x.view(-1), w, res.view(-1), norm_in=norm_w if flags.get("norm_in") else None,
              norm_out=norm_w if flags.get("norm_out") else None)  # fmt: skip


def check(group, n, k, config, device, gen) -> dict:
    """Two launches in a row (the counter must be back at 0 after each) against the float64 recomputation."""
    flags = GROUPS[group][1]
    x, w, res, norm_w = inputs(group, n, k, device, gen)
    want, want_res = reference(group, x, w, res, norm_w)
    op = RowOp(n, k, config, device, **flags)
    errs = []
    for _ in range(2):
        r = res.clone()
        out = run_fused(op, group, x, w, r, norm_w)
        if flags.get("add") and not flags.get("norm_out"):
            out = op.h
        errs.append((rel(out, want), rel(r, want_res) if want_res is not None else 0.0, int(op.counter.item())))
    r = res.clone()
    base = baseline(group, x.clone(), w, r, norm_w)
    base_err = rel(base, want)
    return {"group": group, "config": config, "fused_err": max(e[0] for e in errs),
            "fused_res_err": max(e[1] for e in errs), "counter_after": [e[2] for e in errs],
            "baseline_err": base_err}  # fmt: skip


def time_group(group, n, k, copies, device, gen) -> list[dict]:
    from blas import per_product_us  # the probes' common timer (CUDA only, as this function)

    flags = GROUPS[group][1]
    weights = [(torch.randn(n, k, generator=gen, device=device) * k**-0.5).bfloat16() for _ in range(copies)]
    x, _, res, norm_w = inputs(group, n, k, device, gen)
    rows = []
    xb = x.clone()  # the baseline's norm works in place on its input
    base_us = per_product_us(lambda: [baseline(group, xb, w, res, norm_w, timing=True) for w in weights], copies)
    rows.append({"group": group, "variant": "cublas+flashinfer", "us": base_us})
    print(f"{group:20s} cublas+flashinfer {base_us:7.2f} us", flush=True)
    for config in CONFIGS:
        op = RowOp(n, k, config, device, **flags)
        try:
            us = per_product_us(lambda o=op: [run_fused(o, group, x, w, res, norm_w) for w in weights], copies)
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is recorded and skipped
            print(f"{group:20s} fused {config}: {type(exc).__name__}: {exc}", flush=True)
            continue
        rows.append({"group": group, "variant": f"fused{config}", "config": config, "us": us,
                     "speedup": base_us / us})  # fmt: skip
        print(f"{group:20s} fused {config} {us:7.2f} us ({base_us / us:.3f}x)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--check-only", action="store_true", help="the float64 checks only (tiny shapes on CPU)")
    p.add_argument("--copies", type=int, default=36)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    name = Path(__file__).name
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{name} is a CUDA probe (Triton kernels against cuBLAS): no CUDA device here (its checks on CPU, "
                 "with triton installed: TRITON_INTERPRET=1 ... --device cpu --check-only)")  # fmt: skip
    require_triton(__file__, interpreter_checks=True)
    if device.type == "cpu" and not (args.check_only and os.environ.get("TRITON_INTERPRET") == "1"):
        sys.exit(f"{name} on CPU: the checks alone, under Triton's interpreter (TRITON_INTERPRET=1 ... --check-only)")
    torch.set_grad_enabled(False)
    gen = torch.Generator(device=device).manual_seed(0)
    # (N, K) of the 4B shape's linears, or tiny ones on CPU
    shapes = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "down": (2560, 9728)}
    if device.type == "cpu":
        shapes = {"qkv": (96, 40), "o_proj": (40, 64), "down": (40, 96)}
    checks = []
    for group, (linear, _) in GROUPS.items():
        n, k = shapes[linear]
        for config in CONFIGS if device.type == "cuda" else CONFIGS[:2]:
            row = check(group, n, k, config, device, gen)
            checks.append(row)
            print(f"check {group} {config}: fused {row['fused_err']:.1e} (residual {row['fused_res_err']:.1e}, "
                  f"counter {row['counter_after']}), baseline {row['baseline_err']:.1e}", flush=True)  # fmt: skip
    timings = []
    if not args.check_only:
        for group, (linear, _) in GROUPS.items():
            timings += time_group(group, *shapes[linear], args.copies, device, gen)
        best = {}
        for row in timings:
            g = row["group"]
            if row["variant"] == "cublas+flashinfer":
                best.setdefault(g, {})["base"] = row["us"]
            else:
                best.setdefault(g, {})["fused"] = min(best[g].get("fused", 1e9), row["us"])
        for name, parts in {"A": ["qkv+norm_in", "o+add+norm", "silu+down+add"],
                            "B": ["qkv", "o+add+norm", "silu+down+add+norm"]}.items():  # fmt: skip
            base = sum(best[g]["base"] for g in parts)
            fused = sum(best[g]["fused"] if g != "qkv" or name == "A" else best[g]["base"] for g in parts)
            print(f"layer {name}: {' + '.join(parts)}: baseline {base:.2f} us, fused {fused:.2f} us "
                  f"({base - fused:+.2f} us a layer saved)", flush=True)  # fmt: skip
    if args.out:
        path = Path(args.out) / f"gemv_norm_{time.strftime('%Y%m%d-%H%M%S')}.json"
        meta = {"device": str(device), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                "command": " ".join(sys.argv), "triton": triton.__version__, "torch": torch.__version__}  # fmt: skip
        path.write_text(json.dumps({"meta": meta, "checks": checks, "timings": timings}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
