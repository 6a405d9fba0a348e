"""``cuda_graphs.policy`` against real vLLM config objects and a real forward context."""

from __future__ import annotations

import pytest

# skips the module cleanly where vLLM is not installed (the core test environment)
pytest.importorskip("vllm.config")

from vllm.config import CompilationConfig, CUDAGraphMode, ModelConfig, VllmConfig  # noqa: E402

from higgs_talker.cuda_graphs.policy import decide, local_graphs_allowed_now, vllm_captures_graphs  # noqa: E402


@pytest.fixture(scope="module")
def model_config(tiny_dir):
    from higgs_talker.vllm_plugin import register

    register()
    return ModelConfig(model=str(tiny_dir), dtype="float32", max_model_len=512)


def _config(model_config, enforce_eager: bool, mode: CUDAGraphMode) -> VllmConfig:
    model_config.enforce_eager = enforce_eager
    vc = VllmConfig(model_config=model_config, compilation_config=CompilationConfig())
    # vLLM on CPU normalises the mode to NONE at construction; set it afterwards to exercise every mode
    vc.compilation_config.cudagraph_mode = mode
    return vc


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("mode", list(CUDAGraphMode), ids=lambda m: m.name)
def test_decide_with_real_vllm_config(model_config, enforce_eager, mode):
    vc = _config(model_config, enforce_eager, mode)
    d = decide(vllm_config=vc)
    external = not enforce_eager and mode != CUDAGraphMode.NONE
    assert vllm_captures_graphs(vc)[0] is external
    assert d.local_mlp is (not external)
    assert d.full_decode is False
    assert d.reason.startswith("local MLP graphs " + ("off" if external else "on"))
    if not enforce_eager:
        assert f"cudagraph_mode={mode.name}" in d.reason
    assert vc.compilation_config.cudagraph_mode == mode  # the policy never mutates the config
    assert vc.model_config.enforce_eager is enforce_eager


def test_low_latency_profile_turns_local_graphs_off(model_config):
    vc = _config(model_config, False, CUDAGraphMode.FULL_DECODE_ONLY)
    d = decide(vllm_config=vc)
    assert not d.local_mlp and vllm_captures_graphs(vc)[0] and "FULL_DECODE_ONLY" in d.reason
    assert decide(vllm_config=_config(model_config, True, CUDAGraphMode.FULL_DECODE_ONLY)).local_mlp


def test_eager_mode_request_still_turns_local_graphs_off(model_config):
    vc = _config(model_config, True, CUDAGraphMode.NONE)
    assert not decide(mode="eager", vllm_config=vc).local_mlp


@pytest.mark.parametrize("runtime", list(CUDAGraphMode), ids=lambda m: m.name)
def test_forward_context_graph_mode_gates_local_path(model_config, runtime):
    from vllm.forward_context import get_forward_context, set_forward_context

    if not runtime.is_valid_runtime_mode():
        pytest.skip(f"{runtime.name} is not a runtime mode")
    vc = _config(model_config, True, CUDAGraphMode.NONE)
    with set_forward_context(None, vc, cudagraph_runtime_mode=runtime):
        ctx = get_forward_context()
        assert local_graphs_allowed_now(ctx) is (runtime == CUDAGraphMode.NONE)
    assert local_graphs_allowed_now(None)
