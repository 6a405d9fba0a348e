"""Safetensors checkpoints: key mapping (SPEC 1.2), strict validation, and loading into the model.

Only safetensors are read (single file or sharded via ``model.safetensors.index.json``); nothing is
unpickled. Loading validates every key and shape from the file headers *before* any tensor data is read,
so a bad checkpoint raises without touching the model.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import TalkerConfig

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
Header = dict[str, tuple[Path, tuple[int, ...], str]]  # key -> (file, shape, safetensors dtype)

# checkpoint prefix -> model parameter prefix (SPEC 1.2). Order matters: the codec prefix must be tested
# before the fused-table prefix it shares a stem with.
CODEC_PREFIX = "tied.embedding.modality_embeddings.0.model."
TEXT_HEAD_KEY = "tied.head.text_head.weight"  # absent from a checkpoint whose text head is its text embedding
_PREFIX_MAP = (
    ("tied.embedding.text_embedding.", "model.embed_tokens."),
    ("body.layers.", "model.layers."),
    ("body.norm.", "model.norm."),
    ("tied.head.text_head.", "lm_head."),
    ("tied.embedding.modality_embeddings.0.embedding.", "multimodal_embedding."),
    ("tied.head.modality_heads.0.", "modality_head."),
)
# Checkpoint tensors packed into one model parameter: (checkpoint suffix, packed suffix, shard index).
_PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
LAYER_SUFFIXES = (
    "input_layernorm.weight",
    "mlp.down_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "post_attention_layernorm.weight",
    "self_attn.k_norm.weight",
    "self_attn.k_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.v_proj.weight",
)
_BIAS_SUFFIXES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a model parameter, optionally one shard of a packed parameter."""

    param: str
    shard: int | None = None


def expected_shapes(cfg: TalkerConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key the model requires, with its shape (optional keys are not listed)."""
    t = cfg.text
    h, d = t.hidden_size, t.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "tied.embedding.text_embedding.weight": (t.vocab_size, h),
        "body.norm.weight": (h,),
        "tied.embedding.modality_embeddings.0.embedding.weight": (cfg.num_codebooks * cfg.codebook_size, h),
    }
    layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (t.intermediate_size, h),
        "mlp.up_proj.weight": (t.intermediate_size, h),
        "mlp.down_proj.weight": (h, t.intermediate_size),
        "self_attn.q_proj.weight": (t.q_size, h),
        "self_attn.k_proj.weight": (t.kv_size, h),
        "self_attn.v_proj.weight": (t.kv_size, h),
        "self_attn.o_proj.weight": (h, t.q_size),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
    }
    if t.attention_bias:
        layer |= {
            "self_attn.q_proj.bias": (t.q_size,),
            "self_attn.k_proj.bias": (t.kv_size,),
            "self_attn.v_proj.bias": (t.kv_size,),
        }
    for i in range(t.num_hidden_layers):
        for suffix, shape in layer.items():
            shapes[f"body.layers.{i}.{suffix}"] = shape
    if not t.tie_word_embeddings:
        shapes[TEXT_HEAD_KEY] = (t.vocab_size, h)
    if not cfg.tie_modality_embeddings:
        shapes["tied.head.modality_heads.0.weight"] = (cfg.num_codebooks * cfg.codebook_size, h)
    return shapes


def map_key(key: str, cfg: TalkerConfig) -> Target | None:
    """Checkpoint key -> model target; None for keys that are skipped (codec, tied heads).

    Raises ``ValueError`` for a key no prefix accounts for.
    """
    if key.startswith(CODEC_PREFIX):
        return None  # the bundled codec belongs to Stage 1
    for src, dst in _PREFIX_MAP:
        if key.startswith(src):
            if dst == "lm_head." and cfg.text.tie_word_embeddings:
                return None  # tied: lm_head *is* embed_tokens
            if dst == "modality_head." and cfg.tie_modality_embeddings:
                return None
            name = dst + key[len(src) :]
            break
    else:
        raise ValueError(f"unexpected checkpoint key {key!r}: no known prefix maps it")
    if name.startswith("model.layers."):
        stem, _, leaf = name.rpartition(".")  # leaf: weight / bias
        for ckpt_suffix, (packed, shard) in _PACKED.items():
            if stem.endswith("." + ckpt_suffix):
                return Target(f"{stem[: -len(ckpt_suffix)]}{packed}.{leaf}", shard)
    return Target(name)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (or a single ``.safetensors`` file)."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{path} is not a .safetensors file; only safetensors checkpoints are loaded")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {exc}") from exc
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
        for name in set(weight_map.values()):
            # shards live beside the index; judge the name itself (hub caches symlink their shards)
            if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts or "/" in name:
                raise ValueError(f"{index} names shard {name!r}, which is not a file name inside {path}")
        files = sorted({path / name for name in weight_map.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles:
        raise ValueError(
            f"{path} holds only pickle checkpoints ({', '.join(pickles)}); higgs_talker loads safetensors only "
            "(convert the weights with safetensors.torch.save_file)"
        )
    raise FileNotFoundError(f"no safetensors weights in {path}")


def read_header(files: list[Path]) -> Header:
    """key -> (file, shape, dtype) from the safetensors headers; no tensor data is read."""
    header: Header = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if key in header:
                        raise ValueError(
                            f"checkpoint key {key!r} appears in both {header[key][0].name} and {file.name}"
                        )
                    sl = f.get_slice(key)
                    header[key] = (file, tuple(sl.get_shape()), sl.get_dtype())
        except SafetensorError as exc:
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
        except OSError as exc:
            raise ValueError(f"{file} could not be read: {exc}") from exc
    return header


_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_LAYER_KEY = re.compile(r"body\.layers\.(\d+)\.")


def carries_text_head(directory: Path) -> bool | None:
    """Whether the checkpoint in ``directory`` has a text head weight; None where its weights cannot be listed
    (none there, or unreadable: loading them reports that)."""
    try:
        return TEXT_HEAD_KEY in read_header(checkpoint_files(directory))
    except (OSError, ValueError):
        return None


def read_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TalkerConfig:
    """A checkpoint directory's config (``TalkerConfig.from_pretrained``), a text tie its ``config.json`` leaves
    unsaid read from the weights' names (``carries_text_head``)."""
    return TalkerConfig.from_pretrained(path, overrides, text_head=carries_text_head)


def engine_config(path: str | Path, overrides: Any, loaded: Any) -> TalkerConfig:
    """The config of a serving engine that read ``config.json`` into its own class (vLLM, vllm-omni): the file
    itself (``read_config``) where ``path`` is a directory that has one and ``overrides`` is a dict or None, so a
    field the file leaves out means what it means to the direct engine (vllm-omni's class writes its defaults into
    ``to_dict()``: SPEC 1.1); else the engine's ``loaded`` config (a ``to_dict()`` or a mapping)."""
    if (Path(str(path)) / "config.json").is_file() and isinstance(overrides or {}, dict):
        return read_config(path, overrides)
    return TalkerConfig.from_dict(loaded.to_dict() if hasattr(loaded, "to_dict") else dict(loaded))


def check_checkpoint(path: str | Path, cfg: TalkerConfig) -> Header:
    """Read the safetensors headers of ``path`` and check them against ``cfg``; returns the header.

    Runs before anything is allocated: the config's sizes are first compared with the header's shapes field
    by field (``check_config_fields``, an error names the config field), then key by key (``validate``).
    Reads no tensor data; takes milliseconds whatever sizes the config claims.
    """
    header = read_header(checkpoint_files(path))
    check_config_fields(header, cfg)
    validate(header, cfg)
    return header


def check_config_fields(header: Header, cfg: TalkerConfig) -> None:
    """The config's sizes against the tensors that carry them; ``ValueError`` naming the first field that differs.

    Looks only at a handful of keys (embedding, codebook table, layer 0) and the set of layer indices, so a
    config claiming 10**7 layers or a 10**12-row vocabulary is refused without building anything that large.
    Keys that are absent or mis-shaped beyond these fields are left to ``validate``.
    """
    t = cfg.text
    layers = {int(m.group(1)) for key in header if (m := _LAYER_KEY.match(key))}
    if len(layers) != t.num_hidden_layers:
        held = f"layers {min(layers)}..{max(layers)}" if layers else "no layers"
        raise ValueError(
            f"text_config.num_hidden_layers is {t.num_hidden_layers}, but the checkpoint holds {len(layers)} ({held})"
        )
    n, c = cfg.num_codebooks, cfg.codebook_size
    checks = (  # (key, dim, expected size, the config field(s) that set it), single fields first
        ("tied.embedding.text_embedding.weight", 0, t.vocab_size, f"text_config.vocab_size ({t.vocab_size})"),
        ("tied.embedding.text_embedding.weight", 1, t.hidden_size, f"text_config.hidden_size ({t.hidden_size})"),
        ("body.layers.0.self_attn.q_norm.weight", 0, t.head_dim, f"text_config.head_dim ({t.head_dim})"),
        (
            "body.layers.0.self_attn.q_proj.weight",
            0,
            t.q_size,
            f"text_config.num_attention_heads x head_dim ({t.num_attention_heads} x {t.head_dim} = {t.q_size})",
        ),
        (
            "body.layers.0.self_attn.k_proj.weight",
            0,
            t.kv_size,
            f"text_config.num_key_value_heads x head_dim ({t.num_key_value_heads} x {t.head_dim} = {t.kv_size})",
        ),
        (
            "body.layers.0.mlp.gate_proj.weight",
            0,
            t.intermediate_size,
            f"text_config.intermediate_size ({t.intermediate_size})",
        ),
        (
            "tied.embedding.modality_embeddings.0.embedding.weight",
            0,
            n * c,
            f"audio_encoder_config.num_codebooks x vocab_size ({n} x {c} = {n * c})",
        ),
    )
    for key, dim, want, field in checks:
        if key not in header:
            continue
        shape = list(header[key][1])
        if len(shape) <= dim or shape[dim] != want:
            expected = shape[:dim] + [want] + shape[dim + 1 :]
            raise ValueError(f"{field} does not match the checkpoint: {key!r} has shape {shape}, expected {expected}")


def validate(header: Header, cfg: TalkerConfig) -> None:
    """All checks of a checkpoint against a config, raising one error that lists every problem of a kind."""
    unexpected = []
    for key in header:
        try:
            map_key(key, cfg)
        except ValueError:
            unexpected.append(key)
    if unexpected:
        raise ValueError(f"unexpected checkpoint key(s): {', '.join(sorted(unexpected))}")
    expected = expected_shapes(cfg)
    missing = sorted(k for k in expected if k not in header)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} required key(s): {', '.join(missing)}")
    for key, (_file, shape, dtype) in header.items():
        if key.startswith(CODEC_PREFIX):
            continue
        want = expected.get(key)
        if want is None and map_key(key, cfg) is not None:
            # present although the config does not need it (e.g. a bias with attention_bias false)
            raise ValueError(f"unexpected checkpoint key {key!r} for this config")
        if want is not None and shape != want:
            raise ValueError(f"checkpoint key {key!r} has shape {list(shape)}, expected {list(want)}")
        if want is not None and dtype not in _FLOAT_DTYPES:
            raise ValueError(f"checkpoint key {key!r} has dtype {dtype}; expected a float dtype")


def iter_tensors(
    path: str | Path,
    cfg: TalkerConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    header: Header | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Validated (checkpoint key, tensor) pairs, memory-mapped, moved straight to ``device`` and ``dtype``.

    ``header``: what ``check_checkpoint(path, cfg)`` returned (read and checked here when not given). Skipped
    keys (codec, tied heads) are not read at all.
    """
    if header is None:
        header = check_checkpoint(path, cfg)
    by_file: dict[Path, list[str]] = {}
    for key, (file, _, _) in header.items():
        if map_key(key, cfg) is not None:
            by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in keys:
                tensor = f.get_tensor(key)
                yield key, tensor if dtype is None else tensor.to(dtype)


class WeightRouter:
    """Routes checkpoint-named tensors to model parameters for every loader (``load_into``, the vLLM adapter's
    ``load_weights``) and checks each: a key some prefix maps, a parameter the model has, the checkpoint shape
    the config implies, finite values, each parameter (or packed shard) filled once. ``finish()`` raises for
    required keys never seen and parameters left unfilled, naming them all."""

    def __init__(self, params: dict[str, torch.Tensor], cfg: TalkerConfig) -> None:
        self.params, self.cfg = params, cfg
        self.expected = expected_shapes(cfg)
        self.seen: set[str] = set()
        self.filled: dict[str, set[int | None]] = {}

    def route(self, key: str, tensor: torch.Tensor) -> tuple[Target, torch.Tensor] | None:
        """(target, parameter) for a tensor to load; None for a key that is skipped (codec, tied heads)."""
        target = map_key(key, self.cfg)
        self.seen.add(key)
        if target is None:
            return None
        param = self.params.get(target.param)
        if param is None:
            raise ValueError(f"checkpoint key {key!r} maps to {target.param!r}, which the model does not have")
        want = self.expected.get(key)
        if want is None:
            raise ValueError(f"unexpected checkpoint key {key!r} for this config")
        if tuple(tensor.shape) != want:
            raise ValueError(f"checkpoint key {key!r} has shape {list(tensor.shape)}, expected {list(want)}")
        # A corrupt weight would otherwise decode silently to garbage codes. amax/amin propagate NaN and keep
        # inf, and allocate nothing the size of the tensor.
        if tensor.numel() and not bool(torch.isfinite(torch.stack([tensor.amax(), tensor.amin()])).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"checkpoint key {key!r} holds {bad} non-finite value(s) (NaN/inf)")
        shards = self.filled.setdefault(target.param, set())
        if target.shard in shards:
            raise ValueError(f"checkpoint key {key!r} fills {target.param!r} twice")
        shards.add(target.shard)
        return target, param

    def routed(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[Target, torch.Tensor, torch.Tensor]]:
        """(target, parameter, tensor) for each tensor of ``weights`` to load, checked by ``route``; skipped keys
        (codec, tied heads) are passed over."""
        for key, tensor in weights:
            hit = self.route(key, tensor)
            if hit is not None:
                target, param = hit
                yield target, param, tensor

    def finish(self) -> set[str]:
        """The parameter names filled; raises if a required key or a parameter's fill is missing."""
        missing = sorted(set(self.expected) - self.seen)
        unfilled = []
        for name in self.params:
            if name in _TIED_PARAMS and _is_tied(name, self.cfg):
                continue
            want = {None} if not _is_packed(name) else set(range(3 if "qkv" in name else 2))
            if self.filled.get(name, set()) != want:
                unfilled.append(name)
        problems = []
        if missing:
            problems.append(f"checkpoint is missing {len(missing)} required key(s): {', '.join(missing)}")
        if unfilled:
            problems.append(f"checkpoint does not fill model parameter(s): {', '.join(sorted(unfilled))}")
        if problems:
            raise ValueError("; ".join(problems))
        return set(self.filled)


def load_into(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], cfg: TalkerConfig) -> set[str]:
    """Copy checkpoint-named tensors into ``model``'s parameters; returns the parameter names written.

    Every tensor is staged first and checked (``WeightRouter``); the model is modified only after all of them
    passed, so a failure leaves it as it was.
    """
    router = WeightRouter(dict(model.named_parameters()), cfg)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for target, param, tensor in router.routed(weights):
        dest = param.data if target.shard is None else _shard_view(param.data, target.param, target.shard, cfg)
        staged.append((dest, tensor))
    filled = router.finish()
    with torch.no_grad():
        for dest, tensor in staged:
            dest.copy_(tensor)
    return filled


_TIED_PARAMS = {"lm_head.weight", "modality_head.weight"}


def _is_tied(name: str, cfg: TalkerConfig) -> bool:
    return cfg.text.tie_word_embeddings if name == "lm_head.weight" else cfg.tie_modality_embeddings


def _is_packed(name: str) -> bool:
    return ".qkv_proj." in name or ".gate_up_proj." in name


def _shard_view(data: torch.Tensor, name: str, shard: int, cfg: TalkerConfig) -> torch.Tensor:
    t = cfg.text
    sizes = [t.q_size, t.kv_size, t.kv_size] if ".qkv_proj." in name else [t.intermediate_size] * 2
    start = sum(sizes[:shard])
    return data[start : start + sizes[shard]]


def save_checkpoint(tensors: dict[str, torch.Tensor], directory: str | Path, shards: int = 1) -> None:
    """Write checkpoint-named tensors as safetensors (sharded with an index when ``shards > 1``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if shards <= 1:
        save_file(tensors, str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::shards]}
        save_file(part, str(directory / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")


def export_state(model: torch.nn.Module, cfg: TalkerConfig) -> dict[str, torch.Tensor]:
    """The inverse of loading: checkpoint-named tensors from a model (packed parameters split back)."""
    inverse = {dst: src for src, dst in _PREFIX_MAP}
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name in _TIED_PARAMS and _is_tied(name, cfg):
            continue
        prefix = next(p for p in inverse if name.startswith(p))
        ckpt = inverse[prefix] + name[len(prefix) :]
        if _is_packed(name):
            stem, _, leaf = ckpt.rpartition(".")
            for ckpt_suffix, (packed, shard) in _PACKED.items():
                if stem.endswith("." + packed):
                    key = f"{stem[: -len(packed)]}{ckpt_suffix}.{leaf}"
                    out[key] = _shard_view(param.data, name, shard, cfg).clone()
        else:
            out[ckpt] = param.data.clone()
    return out
