"""config.json parsing and validation (SPEC 1.1, "the 4B checkpoint's shape")."""

from __future__ import annotations

import copy
import json
import re
import shutil
from dataclasses import replace

import pytest

from higgs_talker.checkpoint import engine_config, read_config
from higgs_talker.config import (
    MODEL_TYPE,
    TalkerConfig,
    TextConfig,
    available_memory,
    build_bytes,
    check_fits_device,
    parameter_count,
    register_hf_config,
)
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


def test_audio_encoder_config_names_the_codebooks_and_the_top_level_overrides_the_rest():
    """As upstream's config class (vllm-omni 0.30, checked in its venv): it takes the codebook count and size from
    ``audio_encoder_config``, derives ``tie_modality_embeddings`` and ``audio_hidden_size`` from it, and then its
    keyword arguments (config.json's top level) override those two attributes."""
    audio = {"encoder_type": "discrete", "num_codebooks": 4, "vocab_size": 2000, "tie_word_embeddings": False}
    ids = {"audio_stream_bos_id": 1998, "audio_stream_eos_id": 1999}  # BOC / EOC: the codebook's top two ids
    raw = raw_cfg(num_codebooks=8, codebook_size=1026, tie_modality_embeddings=True, audio_encoder_config=audio, **ids)
    cfg = TalkerConfig.from_dict(raw)
    assert (cfg.num_codebooks, cfg.codebook_size, cfg.max_delay) == (4, 2000, 3)
    assert cfg.tie_modality_embeddings is True
    del raw["tie_modality_embeddings"]
    assert TalkerConfig.from_dict(raw).tie_modality_embeddings is False
    raw = raw_cfg(audio_hidden_size=64, audio_encoder_config=dict(audio, out_dim=32), **ids)
    assert TalkerConfig.from_dict(raw).audio_hidden_size == 64


def test_a_bad_tie_flag_is_named_where_it_was_given():
    with pytest.raises(ValueError, match=re.escape("tie_modality_embeddings must be true or false, got 'no'")):
        TalkerConfig.from_dict(raw_cfg(tie_modality_embeddings="no"))
    audio = {"encoder_type": "discrete", "tie_word_embeddings": 1}
    with pytest.raises(ValueError, match=re.escape("audio_encoder_config.tie_word_embeddings must be true or false")):
        TalkerConfig.from_dict(raw_cfg(audio_encoder_config=audio))


def test_top_level_fields_apply_without_audio_encoder_config():
    ids = {"audio_stream_bos_id": 1098, "audio_stream_eos_id": 1099}  # BOC / EOC: the codebook's top two ids
    cfg = TalkerConfig.from_dict(raw_cfg(num_codebooks=4, codebook_size=1100, **ids))
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
        (lambda r: r.update(audio_encoder_config={"vocab_size": 1030}), "top two ids, 1028 and 1029"),
        (lambda r: r.update(audio_stream_bos_id=1020), "audio_stream_bos_id \\(1020\\)"),
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
        "codes_above_boc_eoc",
        "boc_not_at_the_top",
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


SHAPES = [
    tiny_config(),
    tiny_config(tie_modality_embeddings=False),
    tiny_config(text={"tie_word_embeddings": False, "attention_bias": True}),
    tiny_config(num_codebooks=4, codebook_size=34, boc_id=32, eoc_id=33),
]
SHAPE_IDS = ["tiny", "untied_modality", "untied_text_bias", "small_codebooks"]


@pytest.mark.parametrize("cfg", SHAPES, ids=SHAPE_IDS)
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


# ------------------------------------------------------------------------------------------ strict types, null


def _set(raw: dict, section: str | None, key: str, value) -> dict:
    node = raw if section is None else raw.setdefault(section, {})
    node[key] = value
    return raw


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        # integral floats pass a loose check, then fail inside transformers' strict Qwen3Config
        ("text_config", "hidden_size", 64.0, "text_config.hidden_size must be an integer, got 64.0"),
        ("text_config", "num_hidden_layers", 2.0, "text_config.num_hidden_layers must be an integer, got 2.0"),
        ("text_config", "head_dim", 32.0, "text_config.head_dim must be an integer, got 32.0"),
        ("text_config", "vocab_size", True, "text_config.vocab_size must be an integer, got True"),
        ("text_config", "vocab_size", None, "text_config.vocab_size must be an integer, got None"),
        ("text_config", "num_attention_heads", None, "text_config.num_attention_heads must be an integer, got None"),
        ("text_config", "attention_bias", 0, "text_config.attention_bias must be true or false, got 0"),
        (
            "audio_encoder_config",
            "num_codebooks",
            8.0,
            "audio_encoder_config.num_codebooks must be an integer, got 8.0",
        ),
        ("audio_encoder_config", "out_dim", 64.0, "audio_encoder_config.out_dim must be an integer, got 64.0"),
        (None, "sample_rate", 24000.0, "sample_rate must be an integer, got 24000.0"),
        (None, "audio_stream_bos_id", "1024", "audio_stream_bos_id must be an integer, got '1024'"),
        (None, "eos_token_id", -5, "eos_token_id must be >= 0, got -5"),
        # sizes nothing can hold: refused from the config alone, before any checkpoint is read
        ("text_config", "vocab_size", 10**12, f"text_config.vocab_size must lie in [1, {2**31 - 1}], got {10**12}"),
        ("text_config", "intermediate_size", 2**31, f"text_config.intermediate_size must lie in [1, {2**31 - 1}]"),
        ("text_config", "num_hidden_layers", 10**7, "text_config.num_hidden_layers must be at most 1024, got 10000000"),
        ("text_config", "max_position_embeddings", 2**40, "text_config.max_position_embeddings must lie in"),
        (
            "audio_encoder_config",
            "vocab_size",
            10**10,
            f"codebook_size (audio_encoder_config.vocab_size) must lie in [1, {2**31 - 1}], got {10**10}",
        ),
        (
            "audio_encoder_config",
            "vocab_size",
            300_000_000,
            "num_codebooks x codebook_size (8 x 300000000) must be at most 2147483647",
        ),
    ],
)
def test_strict_types_and_representable_sizes(section, key, value, message):
    raw = _set(raw_cfg(), section, key, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        TalkerConfig.from_dict(raw)


def test_dataclasses_check_types_too():
    """from_config() takes a TalkerConfig built in Python: a float size must not reach the model constructor."""
    with pytest.raises(ValueError, match=re.escape("text_config.hidden_size must be an integer, got 64.0")):
        TalkerConfig(text=TextConfig(320, 64.0, 128, 2, 4, 2, 16))
    with pytest.raises(ValueError, match=re.escape("text_config.num_hidden_layers must be at most 1024, got 1025")):
        TalkerConfig(text=TextConfig(320, 64, 128, 1025, 4, 2, 16))
    assert TalkerConfig(text=TextConfig(320, 64, 128, 1024, 4, 2, 16)).text.num_hidden_layers == 1024  # the limit
    assert TextConfig(320, 64, 128, 2, 4, 2, 16).rms_norm_eps == 1e-6  # Qwen3's default, as from_dict's
    with pytest.raises(ValueError, match=re.escape("tie_modality_embeddings must be true or false, got 1")):
        TalkerConfig(text=TextConfig(320, 64, 128, 2, 4, 2, 16), tie_modality_embeddings=1)


NULLABLE = [
    ("text_config", "num_key_value_heads"),
    ("text_config", "head_dim"),
    ("text_config", "rms_norm_eps"),
    ("text_config", "rope_theta"),
    ("text_config", "max_position_embeddings"),
    ("text_config", "tie_word_embeddings"),
    ("text_config", "attention_bias"),
    ("text_config", "model_type"),
    ("audio_encoder_config", "num_codebooks"),
    ("audio_encoder_config", "vocab_size"),
    ("audio_encoder_config", "out_dim"),
    ("audio_encoder_config", "tie_word_embeddings"),
    (None, "audio_stream_bos_id"),
    (None, "audio_stream_eos_id"),
    (None, "sample_rate"),
    (None, "frame_rate"),
    (None, "audio_token_id"),
    (None, "eos_token_id"),
]


@pytest.mark.parametrize(("section", "key"), NULLABLE)
def test_null_means_the_field_is_absent(section, key):
    full = tiny_config(tie_modality_embeddings=False).to_dict()  # names every field
    absent, null = copy.deepcopy(full), copy.deepcopy(full)
    del (absent if section is None else absent[section])[key]
    _set(null, section, key, None)
    assert TalkerConfig.from_dict(null) == TalkerConfig.from_dict(absent)


def test_null_or_missing_head_dim_is_transformers_default_and_transformers_sees_the_same(tiny_dir, tmp_path):
    """A text_config without head_dim means 128 in transformers' Qwen3Config, through which upstream reads it (on
    the 4B shape hidden // heads would be 80); head_dim: null used to reach transformers as None. A missing
    tie_word_embeddings / rope_theta takes our resolution, not transformers' defaults (false, 10000)."""
    from transformers import AutoConfig

    register_hf_config()
    raw = json.loads((tiny_dir / "config.json").read_text())
    for variant in ("null", "missing"):
        edited = copy.deepcopy(raw)
        if variant == "null":
            edited["text_config"]["head_dim"] = None
        else:
            del edited["text_config"]["head_dim"]
            del edited["text_config"]["tie_word_embeddings"]  # transformers' default is false; no weights here: tied
            del edited["text_config"]["rope_theta"]  # transformers' default is 10000, ours 1e6
        d = tmp_path / variant
        d.mkdir()
        (d / "config.json").write_text(json.dumps(edited))
        cfg = TalkerConfig.from_pretrained(d)
        assert cfg.text.head_dim == 128 and cfg.text.tie_word_embeddings is True
        assert cfg.text.rope_theta == (10000.0 if variant == "null" else 1e6)
        hf = AutoConfig.from_pretrained(str(d))
        assert hf.text_config.head_dim == 128 and hf.text_config.tie_word_embeddings is True
        assert hf.to_talker_config() == cfg


def test_a_checkpoint_of_narrower_heads_without_head_dim_is_refused_naming_it(tiny_dir, tmp_path):
    from higgs_talker import HiggsTalker

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, d)
    raw = json.loads((d / "config.json").read_text())
    del raw["text_config"]["head_dim"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=re.escape("text_config.head_dim (128) does not match the checkpoint")):
        HiggsTalker.from_pretrained(d)


@pytest.mark.parametrize("given", [None, "missing"])
def test_an_unsaid_text_tie_is_read_from_the_checkpoint(tmp_path, given):
    """Where text_config leaves tie_word_embeddings out (or null), a checkpoint with a text head is untied (upstream
    loads that head) and one without is tied."""
    from higgs_talker.tiny import write_checkpoint

    for tied in (True, False):
        d = write_checkpoint(tmp_path / f"tied_{tied}", tiny_config(text={"tie_word_embeddings": tied}), codec=False)
        raw = json.loads((d / "config.json").read_text())
        if given is None:
            raw["text_config"]["tie_word_embeddings"] = None
        else:
            del raw["text_config"]["tie_word_embeddings"]
        (d / "config.json").write_text(json.dumps(raw))
        assert read_config(d).text.tie_word_embeddings is tied
        assert TalkerConfig.from_pretrained(d).text.tie_word_embeddings is True  # weights unread: the default
        assert TalkerConfig.from_dict(raw).text.tie_word_embeddings is True


def test_overrides_lay_over_the_file_as_vllms_hf_overrides_do(tiny_dir):
    cfg = TalkerConfig.from_pretrained(tiny_dir, {"text_config": {"num_hidden_layers": 1}, "frame_rate": 50})
    base = TalkerConfig.from_pretrained(tiny_dir)
    assert cfg.text == replace(base.text, num_hidden_layers=1) and cfg.frame_rate == 50


def test_hf_config_class_raises_our_error_naming_the_field():
    from higgs_talker.config import hf_config_class

    cls = hf_config_class()
    with pytest.raises(ValueError, match=re.escape("text_config.hidden_size must be an integer, got 64.0")):
        cls(text_config=text_cfg(hidden_size=64.0))
    with pytest.raises(ValueError, match=re.escape("text_config.num_hidden_layers must be at most 1024")):
        cls(text_config=text_cfg(num_hidden_layers=10**7))  # transformers would build a 10**7-entry layer_types
    assert cls().text_config.model_type == "qwen3"  # the no-argument form transformers itself uses still works


def test_non_utf8_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'} is not UTF-8 text")):
        TalkerConfig.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------------ memory estimate


@pytest.mark.parametrize("cfg", SHAPES, ids=SHAPE_IDS)
def test_parameter_count_matches_the_model(cfg):
    import torch

    from higgs_talker.model import TalkerModel

    with torch.device("meta"):
        model = TalkerModel(cfg)
    model.tie_weights()
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())


def test_check_fits_device_compares_the_estimate_with_what_is_available(monkeypatch):
    import torch

    from higgs_talker import config

    cfg = tiny_config()
    need, _ = build_bytes(cfg, 2)
    # bf16 weights are materialised in fp32 first: 4 bytes a parameter at the peak, plus the RoPE table's build
    assert need == parameter_count(cfg) * 4 + 4096 * 32 * 28
    monkeypatch.setattr(config, "available_memory", lambda device: need)
    check_fits_device(cfg, torch.device("cpu"), torch.bfloat16)  # exactly enough
    monkeypatch.setattr(config, "available_memory", lambda device: need - 1)
    with pytest.raises(ValueError, match=r"needs about 0\.00\d+ GiB \(730,752 parameters in bfloat16; largest part"):
        check_fits_device(cfg, torch.device("cpu"), torch.bfloat16)


def test_available_cpu_memory_is_plausible():
    import os

    import torch

    avail = available_memory(torch.device("cpu"))
    assert 0 < avail <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_our_hf_class_takes_the_top_level_codebook_fields_as_upstreams_does():
    from higgs_talker.config import hf_config_class

    for audio in (None, {}):
        hf = hf_config_class()(text_config=text_cfg(), num_codebooks=4, codebook_size=1100, audio_encoder_config=audio,
                               audio_stream_bos_id=1098, audio_stream_eos_id=1099)  # fmt: skip
        cfg = hf.to_talker_config()
        assert (cfg.num_codebooks, cfg.codebook_size) == (4, 1100)  # an empty sub-dict names neither
    assert TalkerConfig.from_dict(raw_cfg(num_codebooks=4, audio_encoder_config={})).num_codebooks == 4


class _EngineConfig:
    """A serving engine's config class, which writes its own defaults into ``to_dict()``."""

    def __init__(self, raw: dict) -> None:
        self.raw = raw

    def to_dict(self) -> dict:
        return self.raw


def test_engine_config_reads_the_checkpoints_file_not_the_engines_defaults(tmp_path):
    raw = raw_cfg(num_codebooks=4, tie_modality_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    engine_view = _EngineConfig(raw | {"audio_encoder_config": {"num_codebooks": 8, "tie_word_embeddings": True}})
    cfg = engine_config(tmp_path, None, engine_view)
    assert (cfg.num_codebooks, cfg.tie_modality_embeddings) == (4, False)
    assert engine_config(tmp_path, {"frame_rate": 50}, engine_view).frame_rate == 50
    # no file to read (a hub id), or overrides only the engine can apply: the engine's view
    assert engine_config("org/model", None, engine_view).num_codebooks == 8
    assert engine_config(tmp_path, lambda c: c, engine_view).num_codebooks == 8
