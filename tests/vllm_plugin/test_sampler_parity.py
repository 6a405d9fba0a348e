"""Our top-k / top-p filter against vLLM's own ``apply_top_k_top_p_pytorch`` (the rule SPEC 4.6 names), on
long-tailed code logits with top_p from 0.3 to 1 and top-k on and off."""

from __future__ import annotations

import pytest

# skips the module cleanly where vLLM is not installed (the core test environment)
pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")

import torch  # noqa: E402
from _long_tail import V, cycle, long_tailed_logits  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # noqa: E402

from higgs_talker.heads.sampling import top_k_top_p_filter  # noqa: E402

TOP_P = [0.999999, 0.99999, 0.9999, 0.999, 0.99, 0.95, 0.9, 0.5, 0.3, 1.0]


def _both(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = 2000
    x = long_tailed_logits(m, seed=seed).to(dtype).float()  # no code's fp32 probability underflows to 0
    p = cycle(TOP_P, m)
    k = cycle([V, 50, 600], m, period=len(TOP_P))  # vLLM reads k = V as off
    return top_k_top_p_filter(x, k, p), apply_top_k_top_p_pytorch(x.clone(), k, p)


def test_fp32_logits_give_vllms_result_exactly():
    """Distinct logits: the same codes survive as with vLLM's function, to the bit (ascending fp32 mass)."""
    ours, theirs = _both(torch.float32, seed=7)
    differ = ours.isfinite() != theirs.isfinite()
    assert torch.equal(ours, theirs), f"{int(differ.sum())} codes in {int(differ.any(-1).sum())} rows differ"


def test_bf16_logits_differ_only_in_which_of_equal_logits_survive():
    """bf16 logits repeat values: vLLM's sort is not stable, so which of several equal logits at the nucleus'
    edge survives is its sort's choice (ours: the lowest index). The surviving values are the same."""
    ours, theirs = _both(torch.bfloat16, seed=8)
    for r in range(ours.shape[0]):
        a, b = ours[r][ours[r].isfinite()], theirs[r][theirs[r].isfinite()]
        assert torch.equal(a.sort().values, b.sort().values), r


def test_vllms_sampler_takes_the_warm_up_call_the_adapter_makes():
    """``compat.text_sampler`` warms vLLM's sampler through ``Sampler().topk_topp_sampler(logits, generators, k, p)``:
    the installed vLLM has that call, and it samples one token per row from the rows' top 50 with top-k on, an
    in-range one with it off."""
    from vllm.v1.sample.sampler import Sampler

    sampler, v = Sampler(), 1000
    k50, p95 = torch.full((8,), 50, dtype=torch.int32), torch.full((8,), 0.95)  # the dtypes of vLLM's batch
    for k, p in ((k50, p95), (None, p95), (None, None)):
        logits = torch.randn(8, v, generator=torch.Generator().manual_seed(3))
        allowed = logits.topk(50 if k is not None else v).indices  # before the sampler may filter in place
        tokens = sampler.topk_topp_sampler(logits, {}, k, p)[0]
        assert tokens.shape == (8,) and (allowed == tokens[:, None]).any(1).all(), (k, p, tokens)


def test_the_warm_up_launches_what_serving_launches_under_the_loaders_bf16_default():
    """vLLM builds and loads the model under a bf16 default dtype, and its ``Sampler`` casts the logits to float32: the
    warm-up (``compat.warm_up``, run from ``load_weights``) gives float32 logits and top-p and int32 top-k whatever the
    default (a bf16 warm-up compiled none of serving's kernels: h200_20261205b), every batch with each filter on and
    off, unseeded and seeded; and vLLM's own sampler takes each of those calls."""
    from vllm.v1.sample.sampler import Sampler

    from higgs_talker.vllm_plugin.compat import warm_up

    calls = []

    class Recording:
        def topk_topp_sampler(self, logits, generators, k, p):
            calls.append((tuple(logits.shape), logits.dtype, bool(generators), k is not None and k.dtype,
                          p is not None and p.dtype))  # fmt: skip
            return Sampler().topk_topp_sampler(logits, generators, k, p)

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        warm_up(Recording(), [1, 8], 300, torch.device("cpu"))
    finally:
        torch.set_default_dtype(default)
    assert len(calls) == 2 * 2 * 2 * 2
    assert {c[0] for c in calls} == {(1, 300), (8, 300)}
    assert {c[1] for c in calls} == {torch.float32}
    assert {c[2] for c in calls} == {False, True}  # unseeded and seeded
    assert {c[3] for c in calls} == {False, torch.int32} and {c[4] for c in calls} == {False, torch.float32}
