"""Checkpoint configuration: ``config.json`` of a ``higgs_multimodal_qwen3`` checkpoint, validated.

``TalkerConfig`` is what the runtime passes around (a frozen dataclass). ``HiggsAudioV3Config`` is the
transformers ``PretrainedConfig`` subclass registered for ``model_type == "higgs_multimodal_qwen3"`` so that
``AutoConfig`` can read the checkpoint; it is registered on demand (``register_hf_config``), never at import.

Types are strict: integer fields must be JSON integers (``64``, not ``64.0`` or ``"64"``), flags JSON booleans,
and every integer must fit int32 (``INT32_MAX``), the index type of the kernels. ``null`` means the same as
leaving a field out: optional fields take their default (``head_dim``: 128, as transformers' ``Qwen3Config``,
through which upstream reads the backbone's shape; ``num_key_value_heads``: ``num_attention_heads``, where
transformers takes 32 for an absent key (only its null means the head count): with other than 32 heads, a file
that leaves it out fits at most one of the two readings, and the k/v weights' shapes refuse the other (here, with
an error naming the field);
``tie_word_embeddings``: true, and ``checkpoint.read_config`` decides it by the weights: untied where they carry a
text head; the rest: the defaults of ``TextConfig`` / ``TalkerConfig``), and a required field (``vocab_size``,
``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``) that is ``null`` is an
error. The transformers view gets the resolved values, so no ``null`` and no transformers default (its
``tie_word_embeddings`` is false) ever differs from what the runtime uses. Where a top-level field and
``audio_encoder_config`` both speak, the runtime reads them as upstream's config class does (SPEC 1.1): the codebook
count and size from ``audio_encoder_config``, ``tie_modality_embeddings`` and ``audio_hidden_size`` from the top
level (keyword arguments there override what the class derived from the sub-dict).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

MODEL_TYPE = "higgs_multimodal_qwen3"
ARCHITECTURE = "HiggsMultimodalQwen3ForConditionalGeneration"

# Upstream defaults (SPEC 1.1); the 4B checkpoint uses them all.
DEFAULT_NUM_CODEBOOKS = 8
DEFAULT_CODEBOOK_SIZE = 1026
DEFAULT_BOC_ID = 1024
DEFAULT_EOC_ID = 1025
DEFAULT_ROPE_THETA = 1_000_000.0
QWEN3_HEAD_DIM = 128  # transformers' Qwen3Config default: what a text_config without head_dim means upstream

INT32_MAX = 2**31 - 1  # upper bound of every integer field
# Far above any real Qwen3 (36 layers in the 4B, ~130 in the largest open models); building 1024 layers on the
# meta device takes about a second, 10**7 would take hours.
MAX_LAYERS = 1024
_REQUIRED_TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

REQUIRED_SPECIAL_TOKENS = ("<|tts|>", "<|text|>", "<|audio|>")
OPTIONAL_SPECIAL_TOKENS = ("<|ref_audio|>", "<|ref_text|>")


@dataclass(frozen=True)
class TextConfig:
    """The Qwen3 backbone's shape (``text_config`` of the checkpoint)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    attention_bias: bool = False

    def __post_init__(self) -> None:
        _validate_text(self)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def to_qwen3_config(self, **overrides: Any):
        """The same backbone as a transformers ``Qwen3Config`` (for vLLM's layers and reference models)."""
        from transformers import Qwen3Config

        fields = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
        )
        fields.update(overrides)
        try:  # transformers >= 5 takes RoPE settings as rope_parameters, older releases as rope_theta
            return Qwen3Config(**fields, rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        except (TypeError, ValueError):
            return Qwen3Config(**fields, rope_theta=self.rope_theta)


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids resolved from the tokenizer's added vocabulary (SPEC 1.3)."""

    tts: int
    text: int
    audio: int
    eos: int
    ref_audio: int | None = None
    ref_text: int | None = None


@dataclass(frozen=True)
class TalkerConfig:
    """Everything the talker needs from ``config.json``; validated on construction."""

    text: TextConfig
    num_codebooks: int = DEFAULT_NUM_CODEBOOKS
    codebook_size: int = DEFAULT_CODEBOOK_SIZE
    boc_id: int = DEFAULT_BOC_ID
    eoc_id: int = DEFAULT_EOC_ID
    tie_modality_embeddings: bool = True
    audio_hidden_size: int | None = None
    sample_rate: int = 24000
    frame_rate: int = 25
    audio_token_id: int = -100
    eos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.audio_hidden_size is None:  # normalise, so from_dict(to_dict(cfg)) == cfg
            object.__setattr__(self, "audio_hidden_size", self.text.hidden_size)
        _validate(self)

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def num_real_codes(self) -> int:
        """Codes below this value are real codec entries; BOC/EOC sit at or above it."""
        return min(self.boc_id, self.eoc_id)

    @property
    def max_delay(self) -> int:
        """Rows of ramp-up/ramp-down added by the delay pattern (``num_codebooks - 1``)."""
        return self.num_codebooks - 1

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TalkerConfig:
        """Build from a parsed ``config.json``; raises ``ValueError`` naming the bad field."""
        if not isinstance(raw, dict):
            raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type != MODEL_TYPE:
            raise ValueError(f"config.json model_type is {model_type!r}, expected {MODEL_TYPE!r}")
        text_raw = raw.get("text_config")
        if text_raw is None:
            raise ValueError("config.json has no 'text_config' (the Qwen3 backbone's shape)")
        if hasattr(text_raw, "to_dict"):
            text_raw = text_raw.to_dict()
        if not isinstance(text_raw, dict):
            raise ValueError(f"config.json text_config must be an object, got {type(text_raw).__name__}")
        text = _text_config_from_dict(text_raw)

        audio = raw.get("audio_encoder_config") or {}
        if not isinstance(audio, dict):
            raise ValueError(f"audio_encoder_config must be an object, got {type(audio).__name__}")
        encoder_type = audio.get("encoder_type", "discrete")
        if encoder_type != "discrete":
            raise ValueError(f"audio_encoder_config.encoder_type is {encoder_type!r}; only 'discrete' is supported")
        if _opt(audio, "use_delay_pattern", True) is not True:
            raise ValueError(
                f"audio_encoder_config.use_delay_pattern is {audio['use_delay_pattern']!r}; only checkpoints trained "
                "with the delay pattern (true) are supported"
            )
        # audio_encoder_config is authoritative where it names a field (SPEC 1.1); null counts as absent.
        num_codebooks = _opt(audio, "num_codebooks", _opt(raw, "num_codebooks", DEFAULT_NUM_CODEBOOKS))
        codebook_size = _opt(audio, "vocab_size", _opt(raw, "codebook_size", DEFAULT_CODEBOOK_SIZE))
        # upstream's class sets these two from the sub-dict, then its keyword arguments (the top level) override them
        tie_modality = _given((raw, "tie_modality_embeddings"), (audio, "audio_encoder_config.tie_word_embeddings"))
        audio_hidden = _given((raw, "audio_hidden_size"), (audio, "audio_encoder_config.out_dim"))
        known = {
            "model_type",
            "text_config",
            "audio_encoder_config",
            "num_codebooks",
            "codebook_size",
            "tie_modality_embeddings",
            "audio_stream_bos_id",
            "audio_stream_eos_id",
            "sample_rate",
            "frame_rate",
            "audio_token_id",
            "eos_token_id",
            "audio_hidden_size",
        }
        return cls(
            text=text,
            num_codebooks=_int(num_codebooks, "audio_encoder_config.num_codebooks"),
            codebook_size=_int(codebook_size, "audio_encoder_config.vocab_size"),
            boc_id=_int(_opt(raw, "audio_stream_bos_id", DEFAULT_BOC_ID), "audio_stream_bos_id"),
            eoc_id=_int(_opt(raw, "audio_stream_eos_id", DEFAULT_EOC_ID), "audio_stream_eos_id"),
            tie_modality_embeddings=_bool(*tie_modality) if tie_modality else True,
            audio_hidden_size=_int(*audio_hidden) if audio_hidden else text.hidden_size,
            sample_rate=_int(_opt(raw, "sample_rate", 24000), "sample_rate"),
            frame_rate=_int(_opt(raw, "frame_rate", 25), "frame_rate"),
            audio_token_id=_int(_opt(raw, "audio_token_id", -100), "audio_token_id"),
            eos_token_id=_optional_eos(raw.get("eos_token_id")),
            extra={k: v for k, v in raw.items() if k not in known},
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        overrides: dict[str, Any] | None = None,
        text_head: Callable[[Path], bool | None] | None = None,
    ) -> TalkerConfig:
        """Read ``<path>/config.json`` (or a path to the file itself), with ``overrides`` laid over it as vLLM lays
        its ``hf_overrides`` dict (a dict value updates that section, anything else replaces the field).

        Where ``text_config`` does not say ``tie_word_embeddings``, ``text_head(directory)`` may: True (the
        checkpoint carries a text head: untied, as upstream loads it; its transformers default is false), False
        (tied: the text logits come from the text embedding), None (cannot tell: tied, the default).
        ``checkpoint.read_config`` passes the one that reads the weights' names."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}")
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{file} is not UTF-8 text, so not JSON: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file} is not valid JSON: {exc}") from exc
        if isinstance(raw, dict):
            for key, value in (overrides or {}).items():
                both = isinstance(value, dict) and isinstance(raw.get(key), dict)
                raw[key] = {**raw[key], **value} if both else value
        cfg = cls.from_dict(raw)
        if raw["text_config"].get("tie_word_embeddings") is None and path.is_dir() and text_head is not None:
            head = text_head(path)
            if head is not None:
                cfg = replace(cfg, text=replace(cfg.text, tie_word_embeddings=not head))
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` form (inverse of ``from_dict``)."""
        text = asdict(self.text)
        text["model_type"] = "qwen3"
        out: dict[str, Any] = {
            "model_type": MODEL_TYPE,
            "architectures": [ARCHITECTURE],
            "text_config": text,
            "audio_encoder_config": {
                "encoder_type": "discrete",
                "num_codebooks": self.num_codebooks,
                "vocab_size": self.codebook_size,
                "out_dim": self.audio_hidden_size or self.text.hidden_size,
                "tie_word_embeddings": self.tie_modality_embeddings,
                "use_delay_pattern": True,
            },
            "audio_stream_bos_id": self.boc_id,
            "audio_stream_eos_id": self.eoc_id,
            "sample_rate": self.sample_rate,
            "frame_rate": self.frame_rate,
            "audio_token_id": self.audio_token_id,
        }
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        out.update(self.extra)
        return out


def _given(*places: tuple[dict[str, Any], str]) -> tuple[Any, str] | None:
    """The first of ``(section, "section.key")`` places whose key is given (not null): (value, its name)."""
    for section, name in places:
        value = _opt(section, name.rpartition(".")[2], None)
        if value is not None:
            return value, name
    return None


def _text_config_from_dict(raw: dict[str, Any]) -> TextConfig:
    model_type = _opt(raw, "model_type", "qwen3")
    if model_type != "qwen3":
        raise ValueError(f"text_config.model_type is {model_type!r}; only 'qwen3' backbones are supported")
    for name in _REQUIRED_TEXT_FIELDS:
        if name not in raw:
            raise ValueError(f"text_config is missing {name!r}")
    heads = _int(raw["num_attention_heads"], "text_config.num_attention_heads")
    hidden = _int(raw["hidden_size"], "text_config.hidden_size")
    if heads <= 0:
        raise ValueError(f"text_config.num_attention_heads must be > 0, got {heads}")
    # RoPE may come flat (`rope_theta`), nested (`rope_parameters`, transformers >= 5) or in the older
    # `rope_scaling`; transformers reads both dicts, so each one given is checked
    ropes = {key: raw[key] for key in ("rope_parameters", "rope_scaling") if raw.get(key) is not None}
    for key, rope in ropes.items():
        if not isinstance(rope, dict):
            raise ValueError(f"text_config.{key} must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"text_config.{key} rope_type {rope_type!r} is not supported (only 'default')")
    thetas = {"rope_theta": raw.get("rope_theta")} | {f"{k}.rope_theta": r.get("rope_theta") for k, r in ropes.items()}
    thetas = {name: value for name, value in thetas.items() if value is not None}
    if len(set(thetas.values())) > 1:
        given = ", ".join(f"text_config.{name} ({value!r})" for name, value in thetas.items())
        raise ValueError(
            f"RoPE theta is given differently: {given}; transformers (and vLLM) take a nested one; give RoPE theta "
            "once, or the same value everywhere"
        )
    theta = next(iter(thetas.values()), DEFAULT_ROPE_THETA)
    _check_unsupported_features(raw, ropes)
    return TextConfig(
        vocab_size=_int(raw["vocab_size"], "text_config.vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(raw["intermediate_size"], "text_config.intermediate_size"),
        num_hidden_layers=_int(raw["num_hidden_layers"], "text_config.num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_int(_opt(raw, "num_key_value_heads", heads), "text_config.num_key_value_heads"),
        head_dim=_int(_opt(raw, "head_dim", QWEN3_HEAD_DIM), "text_config.head_dim"),
        rms_norm_eps=_float(_opt(raw, "rms_norm_eps", 1e-6), "text_config.rms_norm_eps"),
        rope_theta=_float(theta, "text_config.rope_theta"),
        max_position_embeddings=_int(
            _opt(raw, "max_position_embeddings", 32768), "text_config.max_position_embeddings"
        ),
        tie_word_embeddings=_bool(_opt(raw, "tie_word_embeddings", True), "text_config.tie_word_embeddings"),
        attention_bias=_bool(_opt(raw, "attention_bias", False), "text_config.attention_bias"),
    )


def _check_unsupported_features(raw: dict[str, Any], ropes: dict[str, dict[str, Any]]) -> None:
    """Refuse Qwen3 settings that transformers (and vLLM) honour but this runtime does not implement, instead of
    silently computing another model: a non-SiLU MLP, sliding-window layers, partial RoPE."""
    act = _opt(raw, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"text_config.hidden_act is {act!r}; only 'silu' (Qwen3's gated SiLU MLP) is supported")
    for where, value in (
        ("", _opt(raw, "partial_rotary_factor", 1.0)),
        *((f"{key}.", rope.get("partial_rotary_factor")) for key, rope in ropes.items()),
    ):
        if value is not None and value != 1:
            raise ValueError(
                f"text_config.{where}partial_rotary_factor is {value!r}; only full-head RoPE (1.0) is supported"
            )
    layer_types = _opt(raw, "layer_types", None)
    use = _opt(raw, "use_sliding_window", False)
    if use is not False:
        _bool(use, "text_config.use_sliding_window")
    window = raw.get("sliding_window", 4096) if use else None  # transformers' Qwen3Config drops it when not used
    if layer_types is not None:  # given explicitly, transformers uses it as is; a sliding layer without a window is
        if not isinstance(layer_types, list) or any(  # full attention there and in vLLM
            t != "full_attention" and not (t == "sliding_attention" and window is None) for t in layer_types
        ):
            raise ValueError(
                f"text_config.layer_types must list only 'full_attention' layers (sliding-window attention is not "
                f"supported; sliding_window {window}), got {layer_types!r}"
            )
        return
    # else transformers' Qwen3Config makes layer i sliding when use_sliding_window is true, sliding_window is set
    # (4096 when absent) and i >= max_window_layers (28 when absent)
    if use is not False:
        first = _opt(raw, "max_window_layers", 28)
        layers = raw.get("num_hidden_layers")
        if window is not None and isinstance(first, int) and isinstance(layers, int) and first < layers:
            raise ValueError(
                f"text_config.use_sliding_window is true (sliding_window {window}, layers {first}..{layers - 1}); "
                "sliding-window attention is not supported"
            )


_TEXT_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def _validate_text(t: TextConfig) -> None:
    """Types and ranges of every backbone field, then the relations between them."""
    for name in _TEXT_INT_FIELDS:
        _in_range(_int(getattr(t, name), f"text_config.{name}"), f"text_config.{name}", 1, INT32_MAX)
    if t.num_hidden_layers > MAX_LAYERS:
        raise ValueError(f"text_config.num_hidden_layers must be at most {MAX_LAYERS}, got {t.num_hidden_layers}")
    for name in ("rms_norm_eps", "rope_theta"):
        _float(getattr(t, name), f"text_config.{name}")
    for name in ("tie_word_embeddings", "attention_bias"):
        _bool(getattr(t, name), f"text_config.{name}")
    if t.num_attention_heads % t.num_key_value_heads:
        raise ValueError(
            f"text_config.num_attention_heads ({t.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({t.num_key_value_heads})"
        )
    if t.head_dim % 2:
        raise ValueError(f"text_config.head_dim must be even for RoPE, got {t.head_dim}")
    if not (t.rms_norm_eps > 0 and math.isfinite(t.rms_norm_eps)):
        raise ValueError(f"text_config.rms_norm_eps must be a finite value > 0, got {t.rms_norm_eps}")
    if not (t.rope_theta > 0 and math.isfinite(t.rope_theta)):
        raise ValueError(f"text_config.rope_theta must be a finite value > 0, got {t.rope_theta}")


def _validate(cfg: TalkerConfig) -> None:
    """Types and ranges of every field, then the relations between them (also for directly built dataclasses)."""
    t = cfg.text
    if not isinstance(t, TextConfig):
        raise ValueError(f"text must be a TextConfig, got {type(t).__name__}")
    _in_range(_int(cfg.num_codebooks, "num_codebooks"), "num_codebooks", 1, INT32_MAX)
    name = "codebook_size (audio_encoder_config.vocab_size)"
    _in_range(_int(cfg.codebook_size, name), name, 1, INT32_MAX)
    if cfg.num_codebooks * cfg.codebook_size > INT32_MAX:
        raise ValueError(
            f"num_codebooks x codebook_size ({cfg.num_codebooks} x {cfg.codebook_size}) must be at most "
            f"{INT32_MAX}: it is the row count of the fused codebook table"
        )
    for name in ("boc_id", "eoc_id"):
        value = _int(getattr(cfg, name), name)
        if not 0 <= value < cfg.codebook_size:
            raise ValueError(
                f"{name} ({value}) must lie in [0, codebook_size={cfg.codebook_size}): codebook_size must "
                "exceed the BOC/EOC ids"
            )
    if cfg.boc_id == cfg.eoc_id:
        raise ValueError(f"audio_stream_bos_id and audio_stream_eos_id must differ, both are {cfg.boc_id}")
    if cfg.num_real_codes <= 0:
        raise ValueError(f"no real codes below BOC/EOC ({cfg.boc_id}/{cfg.eoc_id})")
    top = {cfg.codebook_size - 2, cfg.codebook_size - 1}
    if {cfg.boc_id, cfg.eoc_id} != top:  # ids between the real codes and BOC/EOC could be sampled, never decoded
        raise ValueError(
            f"audio_stream_bos_id ({cfg.boc_id}) and audio_stream_eos_id ({cfg.eoc_id}) must be the codebook's top "
            f"two ids, {min(top)} and {max(top)} for codebook_size (audio_encoder_config.vocab_size) "
            f"{cfg.codebook_size}: every id below them is a real code"
        )
    _bool(cfg.tie_modality_embeddings, "tie_modality_embeddings")
    if cfg.audio_hidden_size is not None and cfg.audio_hidden_size != t.hidden_size:
        raise ValueError(
            f"audio_hidden_size / audio_encoder_config.out_dim ({cfg.audio_hidden_size}) must equal "
            f"text_config.hidden_size ({t.hidden_size}): audio feedback replaces a hidden row"
        )
    for name in ("sample_rate", "frame_rate"):
        _in_range(_int(getattr(cfg, name), name), name, 1, INT32_MAX)
    _in_range(_int(cfg.audio_token_id, "audio_token_id"), "audio_token_id", -INT32_MAX - 1, INT32_MAX)
    if cfg.eos_token_id is not None:
        _in_range(_int(cfg.eos_token_id, "eos_token_id"), "eos_token_id", 0, INT32_MAX)


def _opt(raw: dict[str, Any], key: str, default: Any) -> Any:
    """``raw[key]``, or ``default`` when the key is absent or null."""
    value = raw.get(key)
    return default if value is None else value


def _int(value: Any, name: str) -> int:
    """A JSON integer (not a bool, not an integral float such as 64.0, which transformers' strict configs refuse)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _in_range(value: int, name: str, lo: int, hi: int) -> int:
    if value < lo and lo in (0, 1):
        raise ValueError(f"{name} must be {'>= 0' if lo == 0 else '> 0'}, got {value}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}], got {value}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _optional_eos(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, list):  # transformers allows a list of eos ids; the first is the stop token we force
        if not value:
            return None
        value = value[0]
    return _int(value, "eos_token_id")


# ---------------------------------------------------------------------------------------------------------
# memory needed to build a model of a config (checked before anything is allocated)

# Bytes per element of the RoPE table while it is built: the fp32 buffer the model registers, plus the float64
# angles, cos, sin and their concatenation, plus the fp32 result (ops.rope_cache).
_ROPE_BUILD_BYTES = 4 + 4 + 4 + 4 + 8 + 4


def parameter_count(cfg: TalkerConfig) -> int:
    """Parameters of the model ``cfg`` describes (tied tables counted once), from the config alone."""
    return sum(n for n, _ in _parameter_terms(cfg).values())


def _parameter_terms(cfg: TalkerConfig) -> dict[str, tuple[int, str]]:
    """name -> (parameters, the config fields that set them)."""
    t = cfg.text
    h = t.hidden_size
    rows = cfg.num_codebooks * cfg.codebook_size
    layer = 2 * h + (t.q_size + 2 * t.kv_size) * h + t.q_size * h + 3 * t.intermediate_size * h + 2 * t.head_dim
    if t.attention_bias:
        layer += t.q_size + 2 * t.kv_size
    vocab = f"vocab_size x hidden_size = {t.vocab_size} x {h}"
    table = f"num_codebooks x codebook_size x hidden_size = {cfg.num_codebooks} x {cfg.codebook_size} x {h}"
    terms = {
        "text embedding": (t.vocab_size * h, vocab),
        "codebook table": (rows * h, table),
        "layers": (t.num_hidden_layers * layer + h, f"num_hidden_layers = {t.num_hidden_layers}, {layer} each"),
    }
    if not t.tie_word_embeddings:
        terms["text head"] = (t.vocab_size * h, vocab)
    if not cfg.tie_modality_embeddings:
        terms["codebook head"] = (rows * h, table)
    return terms


def build_bytes(cfg: TalkerConfig, itemsize: int) -> tuple[int, str]:
    """Peak bytes of building the model in a dtype of ``itemsize`` bytes, and its largest part in words.

    The weights are materialised in float32 and then cast (``api._empty_model``), so each parameter costs
    ``max(4, itemsize)`` bytes at the peak; the RoPE table costs ``_ROPE_BUILD_BYTES`` per entry while it is built.
    """
    t = cfg.text
    parts = {name: (n * max(4, itemsize), why) for name, (n, why) in _parameter_terms(cfg).items()}
    rope = f"max_position_embeddings x head_dim = {t.max_position_embeddings} x {t.head_dim}"
    parts["RoPE table"] = (t.max_position_embeddings * t.head_dim * _ROPE_BUILD_BYTES, rope)
    name, (size, why) = max(parts.items(), key=lambda kv: kv[1][0])
    return sum(b for b, _ in parts.values()), f"{name}: {why}, {size / 2**30:.3g} GiB"


def available_memory(device: Any) -> int:
    """Bytes that can still be allocated on ``device`` (a ``torch.device``).

    CUDA: the free memory ``torch.cuda.mem_get_info`` reports, plus what PyTorch's caching allocator holds
    unused (it reuses that before asking the driver). CPU: ``MemAvailable`` of ``/proc/meminfo``
    (free pages plus reclaimable page cache; ``os.sysconf``'s free pages where that file is missing), and no
    more than the cgroup v2 memory limit leaves, where one is set.
    """
    if device.type == "cuda":
        import torch

        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + cached
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return avail


def check_fits_device(cfg: TalkerConfig, device: Any, dtype: Any) -> None:
    """Raise ``ValueError`` before allocating when the model of ``cfg`` in ``dtype`` cannot fit on ``device``."""
    need, largest = build_bytes(cfg, dtype.itemsize)
    avail = available_memory(device)
    if need > avail:
        raise ValueError(
            f"a model of this config does not fit on {device}: building it needs about {need / 2**30:.3g} GiB "
            f"({parameter_count(cfg):,} parameters in {str(dtype).removeprefix('torch.')}; largest part: "
            f"{largest}), but only {avail / 2**30:.3g} GiB is available"
        )


# ---------------------------------------------------------------------------------------------------------
# transformers integration


def hf_config_class() -> type:
    """The ``PretrainedConfig`` subclass for ``higgs_multimodal_qwen3`` (built lazily, imports transformers).

    ``text_config`` is held as a transformers ``Qwen3Config`` (what vLLM reads through ``get_text_config()``);
    ``to_dict()`` writes it back as a plain dict, so the JSON form is unchanged.
    """
    global _HF_CONFIG_CLASS
    if _HF_CONFIG_CLASS is None:
        from transformers import PretrainedConfig, Qwen3Config

        class HiggsAudioV3Config(PretrainedConfig):
            model_type = MODEL_TYPE
            is_composition = True

            def __init__(
                self, text_config: dict | None = None, audio_encoder_config: dict | None = None, **kwargs: Any
            ) -> None:
                if isinstance(text_config, dict):
                    text_config = Qwen3Config(**_qwen3_fields(text_config))
                elif not isinstance(text_config, PretrainedConfig):
                    text_config = Qwen3Config()
                self.text_config = text_config
                if audio_encoder_config is None:  # as upstream's class: from the top-level fields where given
                    audio_encoder_config = {
                        "encoder_type": "discrete",
                        "num_codebooks": kwargs.pop("num_codebooks", DEFAULT_NUM_CODEBOOKS),
                        "vocab_size": kwargs.pop("codebook_size", DEFAULT_CODEBOOK_SIZE),
                        "tie_word_embeddings": True,
                    }
                self.audio_encoder_config = audio_encoder_config
                super().__init__(**kwargs)

            def get_text_config(self, *args: Any, **kwargs: Any) -> PretrainedConfig:
                return self.text_config

            def to_dict(self) -> dict[str, Any]:
                out = super().to_dict()
                if isinstance(self.text_config, PretrainedConfig):
                    out["text_config"] = self.text_config.to_dict()
                return out

            def to_talker_config(self) -> TalkerConfig:
                return TalkerConfig.from_dict(self.to_dict())

        _HF_CONFIG_CLASS = HiggsAudioV3Config
    return _HF_CONFIG_CLASS


_HF_CONFIG_CLASS: type | None = None


def _qwen3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """``Qwen3Config`` keyword arguments for a raw ``text_config``, checked and resolved by our own parser first:
    a bad value raises our ``ValueError`` naming the field (not transformers' strict-dataclass error), and the
    fields we resolve (a null or missing ``head_dim``, ``tie_word_embeddings``, ...) reach transformers with the
    values the runtime uses. Fields we do not read pass through unchanged."""
    resolved = asdict(_text_config_from_dict(raw))
    theta = resolved.pop("rope_theta")
    fields = {k: v for k, v in raw.items() if k != "model_type" and not (k == "rope_theta" and v is None)}
    nested = any("rope_theta" in (raw.get(key) or {}) for key in ("rope_parameters", "rope_scaling"))
    if "rope_theta" not in fields and not nested:
        fields["rope_theta"] = theta  # our default (1e6, the 4B's), not transformers' 10000
    return fields | resolved  # RoPE settings that were given go as they came (flat or nested)


def register_hf_config() -> bool:
    """Register our config class with ``AutoConfig`` unless something (e.g. vllm-omni) already has.

    Returns True when this call registered it.
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE in CONFIG_MAPPING:
        return False
    if importlib.util.find_spec("vllm_omni") is not None:
        return False  # vllm-omni registers its own class on import and refuses an existing entry

    AutoConfig.register(MODEL_TYPE, hf_config_class())
    return True
