"""Tiles of the one-row Triton linear (``higgs_talker.triton_gemv``) against cuBLAS, per linear of the 4B shape.

CUDA only. For qkv, o_proj, gate_up (with SiLU-and-mul: against cuBLAS + FlashInfer's activation kernel) and
down, 36 weight copies (as many as layers: weights stream from HBM) are multiplied in one CUDA graph per variant;
the figure is the median replay time per product. Every tile is first checked against a float64 product.

    python benchmarks/probes/row_gemv.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from blas import per_product_us, shapes  # noqa: E402
from common import ResultFile, environment  # noqa: E402
from optional_triton import require_triton  # noqa: E402

# RowConfig(block_n, block_k, num_warps, num_stages) of higgs_talker.triton_gemv (imported by main: it needs triton)
TILES = list(itertools.product((1, 2, 4), (512, 1024, 2048), (2, 4, 8), (2, 3)))


def cublas(x, w, silu):
    y = F.linear(x, w)
    if silu:
        import flashinfer

        return flashinfer.activation.silu_and_mul(y)
    return y


def reference(x, w, silu):
    y = x.double() @ w.double().T
    if silu:
        g, u = y.to(x.dtype).double().chunk(2, dim=-1)
        return F.silu(g) * u
    return y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--copies", type=int, default=36)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe (Triton kernels against cuBLAS): no CUDA device here")
    require_triton(__file__)
    from higgs_talker.triton_gemv import CONFIGS, RowConfig, row_linear

    torch.set_grad_enabled(False)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (n_out, n_in) in shapes().items():
        silu = name == "gate_up"
        weights = [(torch.randn(n_out, n_in, generator=g, device="cuda") * n_in**-0.5).bfloat16()
                   for _ in range(args.copies)]  # fmt: skip
        x = torch.randn(1, n_in, generator=g, device="cuda").bfloat16()
        want = reference(x, weights[0], silu)
        base = per_product_us(lambda x=x, s=silu, ws=weights: [cublas(x, w, s) for w in ws], args.copies)
        base_err = ((cublas(x, weights[0], silu).double() - want).norm() / want.norm()).item()
        print(f"{name:8s} cublas{'+silu' if silu else ''} {base:7.2f} us  err {base_err:.1e}", flush=True)
        rows.append({"linear": name, "variant": "cublas", "us": base, "rel_err": base_err})
        best = None
        for tile in map(RowConfig._make, TILES):
            try:
                err = ((row_linear(x, weights[0], config=tile, silu_mul=silu).double() - want).norm()
                       / want.norm()).item()  # fmt: skip
                us = per_product_us(lambda t=tile, x=x, s=silu, ws=weights: [row_linear(x, w, config=t, silu_mul=s)
                                                                             for w in ws], args.copies)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is recorded and skipped
                print(f"{name:8s} {tuple(tile)}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            rows.append({"linear": name, "variant": "triton", "tile": list(tile), "us": us, "rel_err": err})
            if best is None or us < best[0]:
                best = (us, tile, err)
        ranked = sorted((r for r in rows if r["linear"] == name and r["variant"] == "triton"), key=lambda r: r["us"])
        for r in ranked[:6]:
            print(f"{name:8s} triton {tuple(r['tile'])} {r['us']:7.2f} us ({base / r['us']:.3f}x)  "
                  f"err {r['rel_err']:.1e}", flush=True)  # fmt: skip
        for tile in map(tuple, CONFIGS):  # the tiles the library's warm-up tries
            r = next((r for r in ranked if tuple(r["tile"]) == tile), None)
            if r:
                print(f"{name:8s} default {tile} {r['us']:7.2f} us ({base / r['us']:.3f}x)", flush=True)
    if args.out:
        result = ResultFile(args.out, "row_gemv", environment(torch.device("cuda"), "probes/row_gemv.py", None))
        result.set("rows", rows)
        print(f"wrote {result.path}")


if __name__ == "__main__":
    main()
