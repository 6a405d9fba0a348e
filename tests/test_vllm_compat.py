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


class _RecordingSampler:
    """Stands in for vLLM's ``Sampler``: records each call of its top-k/top-p sampler."""

    def __init__(self, logprobs_mode=None) -> None:
        self.logprobs_mode, self.calls = logprobs_mode, []

    def topk_topp_sampler(self, logits, generators, k, p):
        self.calls.append((tuple(logits.shape), logits.dtype, generators, k, p))
        return logits.argmax(-1), None


class _BrokenSampler(_RecordingSampler):
    def topk_topp_sampler(self, logits, generators, k, p):
        raise TypeError("topk_topp_sampler() takes 3 positional arguments but 5 were given")


def _engine_config(max_num_seqs: int) -> NS:
    return NS(model_config=NS(logprobs_mode="raw_logits"), scheduler_config=NS(max_num_seqs=max_num_seqs))


class _Generator:
    """Stands in for ``torch.Generator`` on the ``meta`` device (which has none)."""

    def __init__(self, device=None) -> None:
        self.device, self.seed = device, None

    def manual_seed(self, seed: int) -> _Generator:
        self.seed = seed
        return self


@pytest.fixture
def sampler_class(monkeypatch):
    """Put a stand-in ``Sampler`` where ``compat.text_sampler`` imports vLLM's from (and a stand-in generator)."""

    def use(cls):
        monkeypatch.setitem(sys.modules, "vllm.v1.sample.sampler", NS(Sampler=cls))
        monkeypatch.setattr(compat, "_warned", set())
        monkeypatch.setattr(torch, "Generator", _Generator)

    return use


@pytest.mark.parametrize(("max_num_seqs", "batches"), [(64, [1, 8, 16]), (16, [1, 8, 16]), (12, [1, 8]), (4, [1])])
def test_the_text_sampler_meets_every_batch_class_vllm_compiles_for_before_serving(
    sampler_class, max_num_seqs, batches
):
    """Off the CPU, each batch of 1, 8 and 16 rows up to max_num_seqs, top-k and top-p each on and off, unseeded and
    seeded (``meta`` tensors: shapes and dtypes, no device), in float32 under vLLM's loader's bf16 default dtype (a
    warm-up in bf16 compiled none of the kernels serving runs: h200_20261205b); the sampler keeps the config's
    logprobs mode."""
    sampler_class(_RecordingSampler)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as vLLM's loader has it while load_weights runs
    try:
        sampler = compat.text_sampler(_engine_config(max_num_seqs), 1000, torch.device("meta"))
    finally:
        torch.set_default_dtype(default)
    assert sampler.logprobs_mode == "raw_logits"
    got = [(shape, sorted(gens), k is None, p is None) for shape, _, gens, k, p in sampler.calls]
    assert got == [((n, 1000), gens, k_off, p_off) for n in batches for k_off in (False, True)
                   for p_off in (False, True) for gens in ([], [0])]  # fmt: skip
    assert all(g[0].seed == 0 for _, _, g, _, _ in sampler.calls if g)
    for (n, _), dtype, _, k, p in sampler.calls:
        assert dtype == torch.float32  # what vLLM's sampler filters (it casts the logits first)
        assert k is None or (k.shape == (n,) and k.dtype == torch.int32)  # vLLM's batch: int32 top-k, fp32 top-p
        assert p is None or (p.shape == (n,) and p.dtype == torch.float32)


def test_the_text_sampler_is_not_warmed_on_the_cpu_and_a_failing_warm_up_only_warns(sampler_class, caplog):
    sampler_class(_RecordingSampler)
    with caplog.at_level("INFO", logger=compat.__name__):
        assert compat.text_sampler(_engine_config(64), 1000, torch.device("cpu")).calls == []
        assert not caplog.records  # no claim of a warm-up that did not happen
        compat.text_sampler(_engine_config(12), 1000, torch.device("meta"))
        assert [r.getMessage().split(" in ")[0] for r in caplog.records] == [
            "higgs talker: vLLM's text sampler warmed up for batches [1, 8]"
        ]
    caplog.clear()
    sampler_class(_BrokenSampler)
    with caplog.at_level("WARNING", logger=compat.__name__):
        sampler = compat.text_sampler(_engine_config(64), 1000, torch.device("meta"))
    assert isinstance(sampler, _BrokenSampler)
    assert [r.getMessage() for r in caplog.records] == [
        "vLLM's text sampler was not warmed up (TypeError: topk_topp_sampler() takes 3 positional arguments but 5 "
        "were given)"
    ]
