"""Backbone settings the runtime does not implement must be refused, naming the field, not silently ignored.

transformers' Qwen3 (and vLLM, which reads the same config) would honour each of these, so a runtime that ignored
them computed another model than the reference: a GELU MLP run as SiLU, sliding-window layers run with full
attention, partial RoPE rotated over the whole head, a delay-free checkpoint decoded with the delay pattern. And a
config giving RoPE theta both flat and nested with different values resolved to the flat one here, to the nested
one in transformers (so in our own ``AutoConfig`` view and under vLLM).
"""

from __future__ import annotations

import copy

import pytest
from test_config import raw_cfg, text_cfg

from higgs_talker.config import TalkerConfig, hf_config_class

REFUSED = {
    "gelu": ({"hidden_act": "gelu"}, "text_config.hidden_act"),
    "sliding_all_layers": (
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
        "text_config.use_sliding_window",
    ),
    "sliding_default_window_and_layers": (
        {"use_sliding_window": True, "num_hidden_layers": 30},  # transformers: window 4096 from layer 28 on
        "text_config.use_sliding_window",
    ),
    "layer_types_sliding": (
        {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8, "use_sliding_window": True},
        "text_config.layer_types",
    ),
    "layer_types_not_a_list": ({"layer_types": "full_attention"}, "text_config.layer_types"),
    "partial_rotary_flat": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "partial_rotary_nested": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        "partial_rotary_factor",
    ),
    "theta_flat_and_nested_differ": (
        {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        "text_config.rope_theta",
    ),
    "yarn_scaling_beside_default_parameters": (  # transformers builds yarn from rope_scaling here (5.25, checked)
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        },
        "text_config.rope_scaling",
    ),
    "linear_scaling_beside_default_parameters": (
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            "rope_scaling": {"type": "linear", "factor": 8},
        },
        "text_config.rope_scaling",
    ),
    "partial_rotary_in_the_second_dict": (
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            "rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5},
        },
        "text_config.rope_scaling.partial_rotary_factor",
    ),
    "theta_nested_twice_differently": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": {"rope_theta": 5e5}},
        "rope_scaling.rope_theta",
    ),
    "theta_flat_and_rope_scaling_differ": (
        {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "default", "rope_theta": 5e5}},
        "text_config.rope_theta",
    ),
}

ACCEPTED = {  # what real Qwen3 configs carry: full attention everywhere, SiLU, one theta
    "qwen3_4b_fields": {
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 36,
        "rope_scaling": None,
        "rope_theta": 1e6,
    },
    "sliding_flag_but_no_layer_reaches_it": {"use_sliding_window": True, "max_window_layers": 2},
    "sliding_flag_without_window": {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    "layer_types_full": {"layer_types": ["full_attention", "full_attention"]},
    # transformers' Qwen3Config drops the window when use_sliding_window is false: "sliding" layers attend fully
    "sliding_labels_without_a_window": {"layer_types": ["sliding_attention"] * 2, "sliding_window": 8},
    "sliding_labels_with_a_null_window": {
        "layer_types": ["sliding_attention"] * 2,
        "use_sliding_window": True,
        "sliding_window": None,
    },  # fmt: skip
    "partial_rotary_one": {"partial_rotary_factor": 1.0},
    "theta_same_both_ways": {"rope_theta": 250.0, "rope_parameters": {"rope_type": "default", "rope_theta": 250}},
    "null_act": {"hidden_act": None},
    "default_rope_in_both_dicts": {
        "rope_theta": 1e4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        "rope_scaling": {"type": "default", "rope_theta": 1e4},
    },
}


@pytest.mark.parametrize(("overrides", "field"), list(REFUSED.values()), ids=list(REFUSED))
def test_unsupported_backbone_settings_are_refused_naming_the_field(overrides, field):
    raw = raw_cfg(text_config=text_cfg(**overrides))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        TalkerConfig.from_dict(copy.deepcopy(raw))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):  # the transformers view refuses the same
        hf_config_class()(text_config=copy.deepcopy(raw["text_config"]))


@pytest.mark.parametrize("overrides", list(ACCEPTED.values()), ids=list(ACCEPTED))
def test_settings_real_qwen3_configs_carry_are_accepted(overrides):
    cfg = TalkerConfig.from_dict(raw_cfg(text_config=text_cfg(**overrides)))
    assert cfg.text.rope_theta == overrides.get("rope_theta", 1e6)


@pytest.mark.parametrize("value", [False, "no", 0])
def test_a_checkpoint_without_the_delay_pattern_is_refused(value):
    raw = raw_cfg(audio_encoder_config={"use_delay_pattern": value})
    with pytest.raises(ValueError, match=r"audio_encoder_config\.use_delay_pattern"):
        TalkerConfig.from_dict(raw)


@pytest.mark.parametrize("value", [True, None])
def test_use_delay_pattern_true_or_absent_loads(value):
    assert TalkerConfig.from_dict(raw_cfg(audio_encoder_config={"use_delay_pattern": value})).num_codebooks == 8
