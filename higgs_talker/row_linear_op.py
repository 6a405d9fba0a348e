"""Our one-row and few-row Triton linears (``triton_gemv``) as one torch op, for a forward that another framework
traces and graphs (vLLM's decode steps under ``torch.compile`` and FULL CUDA graphs).

``torch.ops.higgs_talker.rows_linear(x, weight)`` is ``x @ weight.T``. Opaque to Dynamo, it decides per call, from
the rows it is given: one row takes ``row_linear``, 2 to ``FEW_ROWS`` rows ``few_rows_linear``, each with the tile
measured for the weight's shape and dtype (``TILES``, filled by ``choose_tiles``), and anything else (more rows, a
weight without a measured tile, a strided input) ``F.linear``. A graph captured at a batch size replays the kernel
chosen at capture. ``use_rows_linear`` gives a framework's linear layers this op in place of their GEMM.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

FEW_ROWS = 16  # triton_gemv.FEW_ROWS (not imported: this module loads without triton)
# (output columns, input columns, few, dtype) -> the tile (``triton_gemv.RowConfig``) measured for such a weight
TILES: dict[tuple[int, int, bool, torch.dtype], tuple[int, int, int, int]] = {}


def _tile_key(weight: Tensor, few: bool) -> tuple[int, int, bool, torch.dtype]:
    """``weight``'s key in ``TILES``: its shape and dtype, and whether the tile is the few-row kernel's."""
    return weight.shape[0], weight.shape[1], few, weight.dtype


def rows_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N]: our Triton kernels where ``TILES`` has a tile for this shape and M."""
    m = x.shape[0]
    few_rows = x.dim() == 2 and 1 <= m <= FEW_ROWS
    tile = TILES.get(_tile_key(weight, m > 1)) if few_rows else None
    if tile is None or not (x.is_contiguous() and weight.is_contiguous()) or x.dtype != weight.dtype:
        return F.linear(x, weight)
    from . import triton_gemv as gemv

    kernel = gemv.few_rows_linear if m > 1 else gemv.row_linear
    return kernel(x, weight, None, gemv.RowConfig(*tile))


def _rows_linear_shape(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# Registered through the dispatcher's own library API rather than ``torch.library.custom_op``, whose Python wrapper
# costs each eager call about 10-20 us more (CPU, torch 2.13: 31 against 13 us for a small F.linear of 9 us); vLLM
# calls the op eagerly on every step its graphs do not hold (prefills, mixed steps), 144 calls a 4B step.
_LIBRARY = torch.library.Library("higgs_talker", "FRAGMENT")
_LIBRARY.define("rows_linear(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("rows_linear", rows_linear, "CompositeExplicitAutograd")
torch.library.register_fake("higgs_talker::rows_linear", _rows_linear_shape, lib=_LIBRARY)


class _OwnPath:
    """The framework's linear as ``choose_row_linears`` times it against our tiles (``F.linear``; gate_up is
    measured without SiLU-and-mul, which the framework runs apart)."""

    row_gemv = "auto"

    def __init__(self) -> None:
        self.row_configs: dict = {}
        self.few_row_configs: dict = {}

    @staticmethod
    def linear(name: str, x: Tensor, layer) -> Tensor:
        return F.linear(x, layer.weight)


def choose_tiles(layers: list) -> list[dict]:
    """Measure, on ``layers`` (each with ``self_attn.qkv_proj`` / ``o_proj`` and ``mlp.gate_up_proj`` /
    ``down_proj`` whose ``weight`` is [N, K]), which linears take our one-row and few-row kernels, and record the
    winners' tiles in ``TILES``. Returns the measurement's rows (``cuda_graphs.kernels.choose_row_linears``'s)."""
    from .cuda_graphs.kernels import ROW_LINEARS, choose_row_linears

    own, layers = _OwnPath(), list(layers)
    rows = [*choose_row_linears(own, layers, silu_gate_up=False),
            *choose_row_linears(own, layers, few=True, silu_gate_up=False)]  # fmt: skip
    for few, table in ((False, own.row_configs), (True, own.few_row_configs)):
        for name, tile in table.items():
            TILES[_tile_key(ROW_LINEARS[name](layers[0]).weight, few)] = tuple(tile)
    return rows


def use_rows_linear(layers: list) -> int:
    """Give the four linears of each layer ``rows_linear`` in place of their GEMM: each linear module's
    ``quant_method`` (an unquantized one, no bias) is given a subclass of its own class whose ``apply`` calls the op.
    Returns the number of linears switched; others keep their own path."""
    from .cuda_graphs.kernels import ROW_LINEARS

    switched = 0
    for layer in layers:
        for of in ROW_LINEARS.values():
            module = of(layer)
            method = getattr(module, "quant_method", None)
            if type(method).__name__ != "UnquantizedLinearMethod" or getattr(module, "bias", None) is not None:
                continue
            method.__class__ = _with_rows_linear(type(method))
            switched += 1
    return switched


_SUBCLASSES: dict[type, type] = {}


def _with_rows_linear(cls: type) -> type:
    """``cls`` with ``apply(layer, x, bias)`` = ``rows_linear(x, layer.weight)`` (no bias: ``use_rows_linear``)."""
    if cls not in _SUBCLASSES:

        def apply(self, layer, x: Tensor, bias: Tensor | None = None) -> Tensor:
            if bias is not None:
                return super(sub, self).apply(layer, x, bias)
            return torch.ops.higgs_talker.rows_linear(x, layer.weight)

        sub = type(f"RowsLinear{cls.__name__}", (cls,), {"apply": apply})
        _SUBCLASSES[cls] = sub
    return _SUBCLASSES[cls]


ASK_KEY = "higgs_row_linears"  # the model config key (vLLM: hf_overrides) that asks for use_measured_rows_linear


def use_measured_rows_linear(layers: list, hf_config) -> str | None:
    """Where ``hf_config`` asks (``ASK_KEY``) and the weights are on a CUDA device: measure the tiles
    (``choose_tiles``) and switch the layers' linears to ``rows_linear`` (``use_rows_linear``). Returns what was
    done, for the log; None where not asked."""
    if not getattr(hf_config, ASK_KEY, False):
        return None
    if os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):  # vLLM's batch-invariant GEMMs come first
        return f"{ASK_KEY}: VLLM_BATCH_INVARIANT is set; the linears stay as they are"
    layers = list(layers)
    weight = getattr(layers[0].self_attn.qkv_proj, "weight", None) if layers else None
    if weight is None or weight.device.type != "cuda":
        return f"{ASK_KEY}: our row linears need a CUDA device; the linears stay as they are"
    rows = choose_tiles(layers)
    switched = use_rows_linear(layers)
    chosen = "; ".join(f"{r['linear']} ({r['rows']} rows) -> {r['chosen']}" for r in rows)
    return f"{ASK_KEY}: {switched} linears take rows_linear; {chosen}"
