"""``vllm_plugin.compat`` without vLLM: request spans rebuilt from each attention backend's metadata, version
parsing, and vllm-omni 0.26's missing ``req_ids`` read from the calling runner."""

from __future__ import annotations

import sys
from types import SimpleNamespace as NS

import pytest
import torch

from higgs_talker.vllm_plugin import compat


@pytest.fixture
def metadata(monkeypatch):
    """Install ``meta`` as the attention metadata of a fake forward context (per-layer dict, as vLLM has it)."""

    def use(meta):
        monkeypatch.setattr(compat, "forward_context", lambda: NS(attn_metadata={"model.layers.0.attn": meta}))

    return use


@pytest.mark.parametrize(
    ("meta", "num_reqs", "positions", "want"),
    [
        # CPU_ATTN / FLASH_ATTN / TRITON_ATTN carry query_start_loc (longer when padded)
        (NS(query_start_loc=torch.tensor([0, 3, 4, 5, 5])), 3, [0, 1, 2, 7, 9], [0, 3, 4, 5]),
        # FlashInfer, decodes first (one token each; their positions may be consecutive), then 2 native prefills
        (NS(num_decodes=2, num_prefills=2, num_actual_tokens=9, prefill=NS()), 4, [100, 101, 0, 1, 2, 5, 6, 7, 8],
         [0, 1, 2, 5, 9]),
        (NS(num_decodes=3, num_prefills=0, num_actual_tokens=3), 3, [10, 11, 12], [0, 1, 2, 3]),
        # FlashInfer with the TRT-LLM prefill path: cum_seq_lens_q of the prefill part
        (NS(num_decodes=1, num_prefills=2, num_actual_tokens=6, prefill=NS(cum_seq_lens_q=torch.tensor([0, 2, 5]))),
         3, [9, 0, 1, 0, 1, 2], [0, 1, 3, 6]),
        (NS(num_decodes=0, num_prefills=1, num_actual_tokens=4, prefill=NS()), 1, [3, 4, 5, 6], [0, 4]),
        # no metadata at all: position jumps, when they give exactly num_reqs spans
        (None, 2, [0, 1, 2, 0, 1], [0, 3, 5]),
    ],
    ids=["query_start_loc", "flashinfer-native", "flashinfer-decodes", "flashinfer-trtllm", "one-prefill", "jumps"],
)  # fmt: skip
def test_step_query_start_loc(metadata, meta, num_reqs, positions, want):
    metadata(meta)
    got = compat.step_query_start_loc(num_reqs, torch.tensor(positions))
    assert got is not None and got.tolist() == want and got.dtype == torch.long


def test_unknowable_spans_are_none_not_a_guess(metadata):
    metadata(None)
    assert compat.step_query_start_loc(2, torch.tensor([0, 1, 2, 3, 4])) is None  # one run of positions, 2 requests
    metadata(NS(num_decodes=1, num_prefills=2, num_actual_tokens=5, prefill=NS()))
    assert compat.step_query_start_loc(3, torch.tensor([7, 0, 1, 2, 3])) is None  # the two prefills touch


@pytest.mark.parametrize(
    ("vllm", "omni", "warned"),
    [
        ("0.31.0", "0.26.0", ["vllm"]),
        ("0.30.0+cpu", "x.y", ["vllm_omni"]),
        ("0.26.1", "0.30.0", []),
        ("0.27.1rc2", "0.30.0+cpu", []),
        ("0.25.9", "0.31.0.dev3", ["vllm", "vllm_omni"]),
    ],
)
def test_check_supported_warns_once_per_release_outside_the_range(monkeypatch, caplog, vllm, omni, warned):
    monkeypatch.setattr(compat, "_warned", set())
    for name, version in (("vllm", vllm), ("vllm_omni", omni)):
        monkeypatch.setitem(sys.modules, name, NS(__version__=version))
    with caplog.at_level("WARNING", logger=compat.__name__):
        compat.check_supported()
        compat.check_supported()
    assert [r.getMessage().split()[0] for r in caplog.records] == warned
