"""Our Triton decode attention compiled for a Hopper GPU (sm_90) on a machine without one: triton's own compiler and
the ptxas it ships take the kernel from source to a cubin, which catches what the interpreter cannot (a dot shape
or an op the GPU backend refuses, an unrolled loop that does not lower). And the PTX shows the split counter as the
merge needs it: one thread's atomic add, acquire-release at GPU scope (a relaxed one fails this), and the dots on
tensor cores.

Needs triton with its NVIDIA backend and the interpreter off: ``make test`` runs it in the vLLM venv, apart from the
interpreter suite. Skipped where triton is missing or ``TRITON_INTERPRET=1`` (``triton.jit`` then gives the
interpreter's function, which does not compile).
"""

from __future__ import annotations

import os
import re

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the Triton interpreter is on: kernels do not compile", allow_module_level=True)
triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from higgs_talker import triton_attention  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
SIGNATURE = {"q_ptr": "*bf16", "qkv_ptr": "*bf16", "qkv_stride": "i32", "pos_ptr": "*i64", "q_weight_ptr": "*bf16",
             "k_weight_ptr": "*bf16", "eps": "fp32", "cos_sin_ptr": "*fp32", "kv_rows_ptr": "*i64",
             "rows_stride": "i32", "cache_ptr": "*bf16", "tables_ptr": "*i32", "table_stride": "i32",
             "lens_ptr": "*i32", "out_ptr": "*bf16", "partial_ptr": "*fp32", "max_sum_ptr": "*fp32",
             "counters_ptr": "*i32", "scale_log2": "fp32"}  # fmt: skip


def _compile(hq: int, hk: int, d: int, splits: int, fused: bool = False):
    group = hq // hk
    constants = {"HQ": hq, "HK": hk, "D": d, "BS": 16, "G": group, "GP": max(16, triton.next_power_of_2(group)),
                 "S": splits, "TILE": triton_attention.TILE, "PRECISION": "tf32", "UPCAST": False,
                 "FUSED": fused, "PDL": True}  # fmt: skip
    signature = SIGNATURE | dict.fromkeys(constants, "constexpr")
    source = ASTSource(fn=triton_attention._paged_decode_kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=HOPPER, options={"num_warps": 4})


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("hq", "hk", "d", "splits"), [(32, 8, 128, 16), (32, 8, 128, 1), (16, 2, 64, 32)])
def test_paged_decode_compiles_for_hopper(hq, hk, d, splits, fused):
    """Both variants: q read as is, or normed and rotated from the qkv rows with the new token's K/V written."""
    kernel = _compile(hq, hk, d, splits, fused)
    assert kernel.asm["cubin"], "no cubin"
    ptx = kernel.asm["ptx"]
    assert_waits_then_lets_dependents_launch(ptx)
    assert "mma" in ptx, "the dots did not lower to tensor-core instructions"
    counts = [line for line in ptx.splitlines() if re.search(r"\batom\.global\.gpu\.acq_rel\.add\b", line)]
    if splits == 1:  # one program a (request, KV head): it writes its output, nothing to count
        assert not counts and "atom" not in ptx, counts
    else:
        assert len(counts) == 1 and counts[0].lstrip().startswith("@"), counts  # one add, predicated to one thread


def test_race_kernel_compiles_for_hopper():
    """The sampler's race at the 4B head's shape (8 codebooks of 1,026 codes): both sorts (the top-k candidates'
    64 keys and the whole row's 2,048) and the bisection loop lower to a cubin."""
    from higgs_talker.heads import sampling, triton_kernels

    signature = {"logits_ptr": "*fp32", "stride_b": "i32", "stride_c": "i32", "temperature_ptr": "*fp32",
                 "top_k_ptr": "*i64", "top_p_ptr": "*fp32", "seeds_ptr": "*i64", "steps_ptr": "*i64",
                 "out_ptr": "*i64", "scratch_ptr": "*i64", "V": "i32"}  # fmt: skip
    constants = {"C": 8, "FILTER": True, "BLOCK": 2048, "CAND": triton_kernels.RACE_CANDIDATES,
                 "CODE_KEY": sampling.CODE_KEY}  # fmt: skip
    source = ASTSource(fn=triton_kernels._race_kernel, signature=signature | dict.fromkeys(constants, "constexpr"),
                       constexprs=constants)  # fmt: skip
    kernel = triton.compile(source, target=HOPPER, options={"num_warps": 4})
    assert kernel.asm["cubin"], "no cubin"


def assert_waits_then_lets_dependents_launch(ptx: str) -> None:
    """Launched with PDL (``higgs_talker.pdl``): the kernel's first instruction of substance waits for the kernel
    before it (griddepcontrol.wait ahead of every global load), and it lets the next one launch later."""
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
    first_load = next(i for i, line in enumerate(lines) if re.match(r"(@%p\d+ )?ld\.global", line))
    assert wait < first_load, (wait, first_load)
    assert any(line.startswith("griddepcontrol.launch_dependents") for line in lines[wait:])


@pytest.mark.parametrize("silu", [False, True])
def test_row_gemv_compiles_for_hopper_with_pdl(silu):
    """The one-row GEMV as it launches on Hopper (PDL on): it waits before loading anything."""
    from higgs_talker import triton_gemv

    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32"}
    constants = {"HAS_BIAS": False, "SILU_MUL": silu, "BLOCK_N": 2, "BLOCK_K": 1024, "PDL": True}
    source = ASTSource(fn=triton_gemv._row_linear_kernel, signature=signature | dict.fromkeys(constants, "constexpr"),
                       constexprs=constants)  # fmt: skip
    kernel = triton.compile(source, target=HOPPER, options={"num_warps": 4, "num_stages": 2})
    assert kernel.asm["cubin"], "no cubin"
    assert_waits_then_lets_dependents_launch(kernel.asm["ptx"])


@pytest.mark.parametrize("silu", [False, True])
def test_few_rows_linear_compiles_for_hopper_with_pdl(silu):
    """The few-row tensor-core kernel as it launches on Hopper (PDL on), at each tile warm-up tries: it compiles
    within the shared memory, and waits before loading anything."""
    from higgs_talker import triton_gemv

    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32",
                 "K": "i32"}  # fmt: skip
    for block_n, block_k, warps, stages in triton_gemv.FEW_ROW_CONFIGS:
        constants = {"HAS_BIAS": False, "SILU_MUL": silu, "BLOCK_N": block_n, "BLOCK_K": block_k, "PDL": True,
                     "IEEE": False, "ROWS": triton_gemv.FEW_ROWS}  # fmt: skip
        signature |= dict.fromkeys(constants, "constexpr")
        source = ASTSource(fn=triton_gemv._few_rows_linear_kernel, signature=signature, constexprs=constants)
        kernel = triton.compile(source, target=HOPPER, options={"num_warps": warps, "num_stages": stages})
        assert kernel.asm["cubin"], "no cubin"
        # the most shared memory a Hopper block may take (227 KiB); a tile above it fails only at launch
        assert kernel.metadata.shared <= 232448, ((block_n, block_k, warps, stages), kernel.metadata.shared)
        assert_waits_then_lets_dependents_launch(kernel.asm["ptx"])
