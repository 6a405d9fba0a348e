"""config.json parsing and validation (SPEC 1.1, "the 4B checkpoint's shape")."""

from __future__ import annotations

import copy
import json

import pytest

from higgs_talker.config import MODEL_TYPE, TalkerConfig, TextConfig, register_hf_config
from higgs_talker.tiny import tiny_config


def text_cfg(**overrides) -> dict:
    text = {
        "model_type": "qwen3",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    }
    text.update(overrides)
    return text


def raw_cfg(**overrides) -> dict:
    raw = {"model_type": MODEL_TYPE, "text_config": text_cfg()}
    raw.update(overrides)
    return raw


def test_defaults_match_upstream():
    cfg = TalkerConfig.from_dict(raw_cfg())
    assert (cfg.num_codebooks, cfg.codebook_size, cfg.boc_id, cfg.eoc_id) == (8, 1026, 1024, 1025)
    assert (cfg.sample_rate, cfg.frame_rate) == (24000, 25)
    assert cfg.num_real_codes == 1024
    assert cfg.max_delay == 7
    assert cfg.tie_modality_embeddings is True
    assert cfg.audio_token_id == -100
    assert cfg.hidden_size == 64
    assert cfg.audio_hidden_size == 64  # out_dim defaults to the backbone's hidden size
    # text_config defaults (the 4B checkpoint's shape): rope theta 1e6 when missing, tied text head
    assert cfg.text.rope_theta == 1_000_000.0
    assert cfg.text.tie_word_embeddings is True
    assert cfg.text.attention_bias is False
    assert cfg.text.rms_norm_eps == 1e-6


def test_real_4b_shape_parses():
    raw = {
        "model_type": MODEL_TYPE,
        "architectures": ["HiggsMultimodalQwen3ForConditionalGeneration"],
        "audio_token_id": -100,
        "audio_encoder_config": {
            "encoder_type": "discrete",
            "num_codebooks": 8,
            "vocab_size": 1026,
            "out_dim": 2560,
            "tie_word_embeddings": True,
            "use_delay_pattern": True,
        },
        "text_config": {
            "model_type": "qwen3",
            "hidden_size": 2560,
            "num_hidden_layers": 36,
            "intermediate_size": 9728,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rms_norm_eps": 1e-6,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000,
        },
        "audio_tokenizer_id": "some/codec-repo",
    }
    cfg = TalkerConfig.from_dict(raw)
    assert cfg.text.q_size == 4096 and cfg.text.kv_size == 1024
    assert cfg.audio_hidden_size == 2560
    assert cfg.extra["audio_tokenizer_id"] == "some/codec-repo"  # unknown keys survive


def test_audio_encoder_config_is_authoritative():
    raw = raw_cfg(
        num_codebooks=8,
        codebook_size=1026,
        tie_modality_embeddings=True,
        audio_encoder_config={
            "encoder_type": "discrete",
            "num_codebooks": 4,
            "vocab_size": 2000,
            "tie_word_embeddings": False,
        },
    )
    cfg = TalkerConfig.from_dict(raw)
    assert cfg.num_codebooks == 4
    assert cfg.codebook_size == 2000
    assert cfg.tie_modality_embeddings is False
    assert cfg.max_delay == 3


def test_top_level_fields_apply_without_audio_encoder_config():
    cfg = TalkerConfig.from_dict(raw_cfg(num_codebooks=4, codebook_size=1100))
    assert (cfg.num_codebooks, cfg.codebook_size) == (4, 1100)


@pytest.mark.parametrize(
    "text_overrides, theta",
    [
        ({"rope_theta": 10000.0}, 10000.0),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}, 5000.0),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 250.0}, "rope_theta": 250.0}, 250.0),
        ({}, 1_000_000.0),
    ],
    ids=["flat", "nested", "both", "missing"],
)
def test_rope_theta_flat_or_nested(text_overrides, theta):
    cfg = TalkerConfig.from_dict(raw_cfg(text_config=text_cfg(**text_overrides)))
    assert cfg.text.rope_theta == theta


def test_unsupported_rope_type_is_rejected():
    raw = raw_cfg(text_config=text_cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}))
    with pytest.raises(ValueError, match="rope_type"):
        TalkerConfig.from_dict(raw)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r.update(audio_encoder_config={"num_codebooks": 0}), "num_codebooks"),
        (lambda r: r.update(audio_encoder_config={"num_codebooks": -2}), "num_codebooks"),
        (lambda r: r.update(audio_encoder_config={"vocab_size": 1024}), "codebook_size"),
        (lambda r: r.update(audio_encoder_config={"vocab_size": 1025}), "codebook_size"),
        (lambda r: r["text_config"].update(num_attention_heads=6, num_key_value_heads=4), "num_key_value_heads"),
        (lambda r: r.pop("text_config"), "text_config"),
        (lambda r: r.update(model_type="qwen3"), "model_type"),
        (lambda r: r.pop("model_type"), "model_type"),
        (lambda r: r.update(audio_encoder_config={"out_dim": 128}), "out_dim"),
        (lambda r: r.update(audio_encoder_config={"out_dim": 0}), "out_dim"),
        (lambda r: r["text_config"].update(model_type="llama"), "model_type"),
        (lambda r: r["text_config"].pop("hidden_size"), "hidden_size"),
        (lambda r: r["text_config"].update(head_dim=31), "head_dim"),
        (lambda r: r["text_config"].update(vocab_size=0), "vocab_size"),
        (lambda r: r["text_config"].update(rms_norm_eps=float("nan")), "rms_norm_eps"),
        (lambda r: r["text_config"].update(rope_theta=-1.0), "rope_theta"),
        (lambda r: r["text_config"].update(tie_word_embeddings="yes"), "tie_word_embeddings"),
        (lambda r: r["text_config"].update(num_hidden_layers=2.5), "num_hidden_layers"),
        (lambda r: r.update(audio_stream_bos_id=1025), "audio_stream_eos_id"),
        (lambda r: r.update(audio_encoder_config={"encoder_type": "continuous"}), "encoder_type"),
        (lambda r: r.update(sample_rate=0), "sample_rate"),
    ],
    ids=[
        "num_codebooks_zero",
        "num_codebooks_negative",
        "codebook_size_eq_boc",
        "codebook_size_eq_eoc",
        "heads_not_dividing",
        "missing_text_config",
        "wrong_model_type",
        "missing_model_type",
        "out_dim_not_hidden",
        "out_dim_zero",
        "text_model_type",
        "missing_hidden_size",
        "odd_head_dim",
        "zero_vocab",
        "nan_eps",
        "negative_theta",
        "non_bool_tie",
        "float_layers",
        "boc_equals_eoc",
        "continuous_encoder",
        "zero_sample_rate",
    ],
)
def test_validation_errors_name_the_field(mutate, field):
    raw = copy.deepcopy(raw_cfg())
    mutate(raw)
    with pytest.raises(ValueError, match=field):
        TalkerConfig.from_dict(raw)


def test_codebook_size_error_mentions_boc_eoc():
    with pytest.raises(ValueError, match=r"boc_id \(1024\).*codebook_size=1024"):
        TalkerConfig.from_dict(raw_cfg(audio_encoder_config={"vocab_size": 1024}))


def test_dataclass_validates_directly():
    text = TextConfig(**{k: v for k, v in text_cfg().items() if k != "model_type"})
    with pytest.raises(ValueError, match="num_codebooks"):
        TalkerConfig(text=text, num_codebooks=0)
    with pytest.raises(ValueError, match="num_attention_heads"):
        TalkerConfig(text=TextConfig(320, 64, 128, 2, 4, 3, 16))


def test_non_dict_inputs_are_rejected():
    with pytest.raises(ValueError, match="JSON object"):
        TalkerConfig.from_dict(["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="text_config"):
        TalkerConfig.from_dict(raw_cfg(text_config="qwen3"))
    with pytest.raises(ValueError, match="audio_encoder_config"):
        TalkerConfig.from_dict(raw_cfg(audio_encoder_config=[8, 1026]))


@pytest.mark.parametrize(
    "cfg",
    [
        tiny_config(),
        tiny_config(tie_modality_embeddings=False),
        tiny_config(text={"tie_word_embeddings": False, "attention_bias": True}),
        tiny_config(num_codebooks=4, codebook_size=40, boc_id=32, eoc_id=33),
    ],
    ids=["tiny", "untied_modality", "untied_text_bias", "small_codebooks"],
)
def test_to_dict_from_dict_round_trip(cfg):
    raw = cfg.to_dict()
    again = TalkerConfig.from_dict(json.loads(json.dumps(raw)))  # survives JSON too
    assert again == cfg
    assert again.to_dict() == raw


def test_from_pretrained_reads_file_and_dir(tmp_path):
    cfg = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert TalkerConfig.from_pretrained(tmp_path) == cfg
    assert TalkerConfig.from_pretrained(tmp_path / "config.json") == cfg
    with pytest.raises(FileNotFoundError):
        TalkerConfig.from_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        TalkerConfig.from_pretrained(tmp_path)


def test_eos_token_id_may_be_a_list():
    assert TalkerConfig.from_dict(raw_cfg(eos_token_id=[151643, 151645])).eos_token_id == 151643
    assert TalkerConfig.from_dict(raw_cfg(eos_token_id=None)).eos_token_id is None


def test_register_hf_config_makes_autoconfig_work(tiny_dir):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    register_hf_config()
    assert MODEL_TYPE in CONFIG_MAPPING
    assert register_hf_config() is False  # idempotent: a second call registers nothing
    hf = AutoConfig.from_pretrained(str(tiny_dir))
    assert hf.model_type == MODEL_TYPE
    assert type(hf).__name__ == "HiggsAudioV3Config"
    assert hf.to_talker_config() == TalkerConfig.from_pretrained(tiny_dir)


def test_hf_config_save_pretrained_round_trip(tiny_dir, tmp_path):
    from transformers import AutoConfig, Qwen3Config

    register_hf_config()
    hf = AutoConfig.from_pretrained(str(tiny_dir))
    hf.save_pretrained(str(tmp_path))
    assert TalkerConfig.from_pretrained(tmp_path) == TalkerConfig.from_pretrained(tiny_dir)
    # a text_config given as a transformers Qwen3Config object is accepted as well
    text = Qwen3Config(**{k: v for k, v in text_cfg(rope_theta=321.0).items() if k != "model_type"})
    cfg = type(hf)(text_config=text).to_talker_config()
    assert cfg.text.rope_theta == 321.0 and cfg.text.head_dim == 32 and cfg.num_codebooks == 8
