"""Would one kernel for "one-row GEMV + residual add + RMSNorm" beat cuBLAS and FlashInfer's norm at batch 1?

At batch 1 a decode step is latency-bound kernel by kernel. After o_proj a layer runs cuBLAS's split-K GEMV, its
split-K reduce and FlashInfer's fused add+RMSNorm (7.9 + 1.9 + 2.7 us on the H200); after the MLP, SiLU-and-mul,
the down GEMV, its reduce and the next layer's add+RMSNorm (2.4 + 15.0 + 1.9 + 2.7 us;
``results/h200_20261202b/profile_step_full_fused_20261202-0431.log``). This probe times, per layer, those
sequences against one Triton kernel each that multiplies the row (for down, after SiLU-and-mul of its gate|up
input, done while loading it), adds the residual, and normalises in the last program to finish: every program
writes its rows of the new residual and its partial sum of squares, takes a ticket from a counter, and the one
that draws the last ticket sums the partials in program order (deterministic), normalises every row, and resets
the counter for the next launch.

Numerics follow the unfused path: the GEMV's fp32 sum rounded to bf16 (as cuBLAS stores it), SiLU-and-mul
rounded to bf16 (as FlashInfer's kernel stores it), then FlashInfer's fused add+RMSNorm: the sum and the squares
in fp32, the new residual rounded once, the output ``bf16(h * rstd * w)``. Each variant's output and residual are
checked against a float64 recomputation before it is timed.

CUDA only (the kernel also runs under ``TRITON_INTERPRET=1`` on CPU: ``--check-only --device cpu``, tiny shapes).
36 weight copies per graph, so weights stream from HBM as in a step; several tile configurations per shape.

    python benchmarks/probes/gemv_norm.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

EPS = 1e-6
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the last session's best one-row GEMV tiles, and neighbours
CONFIGS = [(2, 1024, 4, 2), (4, 512, 4, 3), (2, 512, 4, 3), (4, 1024, 4, 2), (8, 512, 8, 3), (1, 2048, 4, 2)]


@triton.jit
def _gemv_add_norm_kernel(
    x_ptr, w_ptr, res_ptr, norm_w_ptr, out_ptr, h_ptr, partial_ptr, counter_ptr, N, K, eps,
    SILU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FINAL_BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        if SILU:  # x is gate | up [2K]: the SiLU-and-mul of this chunk, rounded as the separate kernel stores it
            g = tl.load(x_ptr + cols, mask=col_ok, other=0).to(tl.float32)
            u = tl.load(x_ptr + K + cols, mask=col_ok, other=0).to(tl.float32)
            xk = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            xk = tl.load(x_ptr + cols, mask=col_ok, other=0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0)  # fmt: skip
        acc += w.to(tl.float32) * xk[None, :]
    y = tl.sum(acc, axis=1).to(res_ptr.dtype.element_ty).to(tl.float32)  # the GEMV's output, rounded
    h = y + tl.load(res_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    tl.store(res_ptr + rows, h.to(res_ptr.dtype.element_ty), mask=row_ok)  # the new residual (in place)
    tl.store(h_ptr + rows, h, mask=row_ok)  # fp32 h, read back by the last program
    tl.store(partial_ptr + pid, tl.sum(tl.where(row_ok, h * h, 0.0), axis=0))
    tl.debug_barrier()  # every thread's stores before the ticket (the atomic releases them at GPU scope)
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if ticket == programs - 1:  # the last program: every other program's rows and partial are visible now
        tl.debug_barrier()
        total = tl.zeros([FINAL_BLOCK], dtype=tl.float32)
        for p0 in range(0, programs, FINAL_BLOCK):
            p = p0 + tl.arange(0, FINAL_BLOCK)
            total += tl.load(partial_ptr + p, mask=p < programs, other=0.0, cache_modifier=".cg")
        rstd = tl.rsqrt(tl.sum(total, axis=0) / N + eps)
        for n0 in range(0, N, FINAL_BLOCK):
            n = n0 + tl.arange(0, FINAL_BLOCK)
            hn = tl.load(h_ptr + n, mask=n < N, other=0.0, cache_modifier=".cg")
            wn = tl.load(norm_w_ptr + n, mask=n < N, other=0).to(tl.float32)
            tl.store(out_ptr + n, (hn * rstd * wn).to(out_ptr.dtype.element_ty), mask=n < N)
        tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch (stream order)


class GemvAddNorm:
    """One-row ``x @ W.T`` (+ SiLU-and-mul of x first) + residual add + RMSNorm in one launch: the residual is
    updated in place and ``out`` [N] (bf16) holds the normalised row."""

    def __init__(self, n: int, k: int, config: tuple[int, int, int, int], device) -> None:
        self.n, self.k = n, k
        self.block_n, self.block_k, self.warps, self.stages = config
        self.programs = triton.cdiv(n, self.block_n)
        self.partial = torch.zeros(self.programs, dtype=torch.float32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.h = torch.empty(n, dtype=torch.float32, device=device)
        self.out = torch.empty(n, dtype=torch.bfloat16, device=device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, norm_w: torch.Tensor, silu: bool):
        _gemv_add_norm_kernel[(self.programs,)](
            x, w, res, norm_w, self.out, self.h, self.partial, self.counter, self.n, self.k, EPS,
            SILU=silu, BLOCK_N=self.block_n, BLOCK_K=self.block_k, FINAL_BLOCK=1024,
            num_warps=self.warps, num_stages=self.stages,
        )  # fmt: skip
        return self.out


def reference(x, w, res, norm_w, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 recomputation with the unfused path's roundings -> (normalised row fp64, new residual bf16)."""
    if silu:
        g, u = x.double().chunk(2, dim=-1)
        x = (F.silu(g) * u).to(x.dtype)
    y = (w.double() @ x.double().flatten()).to(res.dtype).double()  # the GEMV's bf16 output
    h = y + res.double()
    rstd = torch.rsqrt(h.pow(2).mean() + EPS)
    return h * rstd * norm_w.double(), h.to(res.dtype)


def baseline(x, w, res, norm_w, silu: bool) -> torch.Tensor:
    """What a layer runs today: (SiLU-and-mul,) cuBLAS, FlashInfer's fused add+RMSNorm (torch where absent)."""
    try:
        import flashinfer

        if silu:
            x = flashinfer.activation.silu_and_mul(x)
        y = F.linear(x, w)
        flashinfer.norm.fused_add_rmsnorm(y, res, norm_w, EPS)
        return y
    except ImportError:
        if silu:
            g, u = x.chunk(2, dim=-1)
            x = (F.silu(g.float()) * u.float()).to(x.dtype)
        h = F.linear(x, w).float() + res.float()
        res.copy_(h.to(res.dtype))
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.float()).to(res.dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return ((a - b).norm() / b.norm()).item()


def check(name, n, k, silu, config, device, gen) -> dict:
    """One launch of the kernel (and of the baseline) against the float64 recomputation, twice in a row (the
    counter must be back at 0 after each launch)."""
    x = torch.randn(1, 2 * k if silu else k, generator=gen, device=device).bfloat16()
    w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).bfloat16()
    res = torch.randn(n, generator=gen, device=device).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(n, generator=gen, device=device)).bfloat16()
    want, want_res = reference(x, w, res, norm_w, silu)
    fused = GemvAddNorm(n, k, config, device)
    errs = []
    for _ in range(2):
        r = res.clone()
        out = fused(x, w, r, norm_w, silu)
        errs.append((rel(out, want), rel(r, want_res.double()), int(fused.counter.item())))
    r = res.clone()
    base = baseline(x, w, r.view(1, -1), norm_w, silu)
    return {"linear": name, "config": config, "fused_err": max(e[0] for e in errs),
            "fused_res_err": max(e[1] for e in errs), "counter_after": [e[2] for e in errs],
            "baseline_err": rel(base, want), "baseline_res_err": rel(r, want_res.double())}  # fmt: skip


def time_variants(name, n, k, silu, copies, device, gen) -> list[dict]:
    from higgs_talker.cuda_graphs.capture import capture_graph, median_ms

    weights = [(torch.randn(n, k, generator=gen, device=device) * k**-0.5).bfloat16() for _ in range(copies)]
    x = torch.randn(1, 2 * k if silu else k, generator=gen, device=device).bfloat16()
    res = torch.randn(1, n, generator=gen, device=device).bfloat16()
    norm_w = torch.ones(n, device=device).bfloat16()
    rows = []

    def timed(fn) -> float:
        graph, _ = capture_graph(fn)
        return median_ms(lambda: [graph.replay() for _ in range(5)], iters=7) * 1e3 / (5 * copies)

    base_us = timed(lambda: [baseline(x, w, res, norm_w, silu) for w in weights])
    rows.append({"linear": name, "variant": "cublas+flashinfer", "us": base_us})
    print(f"{name:6s} cublas+flashinfer {base_us:7.2f} us per layer", flush=True)
    for config in CONFIGS:
        fused = GemvAddNorm(n, k, config, device)
        try:
            us = timed(lambda f=fused: [f(x, w, res.view(-1), norm_w, silu) for w in weights])
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is recorded and skipped
            print(f"{name:6s} fused {config}: {type(exc).__name__}: {exc}", flush=True)
            continue
        rows.append({"linear": name, "variant": f"fused{config}", "us": us, "speedup": base_us / us})
        print(f"{name:6s} fused {config} {us:7.2f} us per layer ({base_us / us:.3f}x)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--check-only", action="store_true", help="the float64 checks only (tiny shapes on CPU)")
    p.add_argument("--copies", type=int, default=36)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    # (name, N, K, SiLU-and-mul first): the 4B shape's o_proj and down_proj, or tiny ones on CPU
    shapes = [("o_proj", 2560, 4096, False), ("down", 2560, 9728, True)]
    if device.type == "cpu":
        shapes = [("o_proj", 48, 96, False), ("down", 40, 160, True)]
    checks = []
    for name, n, k, silu in shapes:
        for config in CONFIGS if device.type == "cuda" else CONFIGS[:2]:
            row = check(name, n, k, silu, config, device, gen)
            checks.append(row)
            print(f"check {name} {config}: fused {row['fused_err']:.1e} (residual {row['fused_res_err']:.1e}, "
                  f"counter {row['counter_after']}), baseline {row['baseline_err']:.1e} "
                  f"(residual {row['baseline_res_err']:.1e})", flush=True)  # fmt: skip
    timings = []
    if not args.check_only:
        for name, n, k, silu in shapes:
            timings += time_variants(name, n, k, silu, args.copies, device, gen)
    if args.out:
        path = Path(args.out) / f"gemv_norm_{time.strftime('%Y%m%d-%H%M%S')}.json"
        meta = {"device": str(device), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                "command": " ".join(sys.argv), "triton": triton.__version__, "torch": torch.__version__}  # fmt: skip
        path.write_text(json.dumps({"meta": meta, "checks": checks, "timings": timings}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
