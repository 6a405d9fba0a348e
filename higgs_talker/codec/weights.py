"""Where codec weights come from, and loading them strictly (every problem of a checkpoint in one error).

Two sources hold a codec:

- a talker checkpoint: its keys under ``CODEC_PREFIX`` are the codec (SPEC_codec 1.1). The real checkpoint has
  no codec config, so the built-in ``HIGGS_V3_CODEC`` applies unless the directory has our
  ``codec_config.json`` (the tiny checkpoint does);
- an audio tokenizer directory in transformers' layout (``config.json`` with ``model_type``
  ``higgs_audio_v2_tokenizer`` and unprefixed safetensors), the kind upstream loads to encode references.

Loading checks the safetensors headers before any tensor is read: every missing, unexpected, mis-shaped or
non-float key is reported in one ``ValueError``; a tensor holding NaN/inf is refused when read; the model is
assembled only once everything passed, so a failure leaves nothing half-loaded. Keys are transformers' names
with the renames older exports need: ``weight_g`` / ``weight_v`` (weight norm) become
``parametrizations.weight.original0`` / ``original1``, a quantizer's ``codebook.weight`` (the name of upstream's
``nn.Embedding``, which upstream's loader also takes) becomes ``codebook.embed``, and HuBERT's training-only
``masked_spec_embed`` is dropped (SPEC_codec 2).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoint import CODEC_PREFIX, checkpoint_files, read_header
from .config import CODEC_CONFIG_FILE, HIGGS_V3_CODEC, TOKENIZER_MODEL_TYPE, build_config, read_config_file
from .model import CodecModel, unused_shapes

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_DROPPED = ("semantic_model.masked_spec_embed",)
_LISTED = 12  # names shown per kind of problem; the count is always given


@dataclass(frozen=True)
class CodecSource:
    """A directory's codec: its config, and checkpoint key -> (file, shape, safetensors dtype) with model names."""

    path: Path
    config: object  # HiggsAudioV2TokenizerConfig
    tensors: dict[str, tuple[str, Path, tuple[int, ...], str]]  # model name -> (checkpoint key, file, shape, dtype)
    kind: str  # "checkpoint" (bundled keys) or "tokenizer" (a transformers audio tokenizer directory)


def find_source(path: str | Path) -> CodecSource | None:
    """The codec in a talker checkpoint or audio tokenizer directory; None when it holds none."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"codec directory {str(path)!r} does not exist")
    if _is_tokenizer_dir(path):
        return _source(path, read_config_file(path / "config.json"), prefix="", kind="tokenizer")
    header = read_header(checkpoint_files(path))
    if not any(k.startswith(CODEC_PREFIX) for k in header):
        return None
    file = path / CODEC_CONFIG_FILE
    config = read_config_file(file) if file.is_file() else build_config(HIGGS_V3_CODEC)
    return _source(path, config, prefix=CODEC_PREFIX, kind="checkpoint", header=header)


def _is_tokenizer_dir(path: Path) -> bool:
    file = path / "config.json"
    if not file.is_file():
        return False
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not a readable JSON file: {exc}") from exc
    return isinstance(raw, dict) and raw.get("model_type") == TOKENIZER_MODEL_TYPE


def _source(path: Path, config, prefix: str, kind: str, header=None) -> CodecSource:
    header = header if header is not None else read_header(checkpoint_files(path))
    tensors = {}
    for key, (file, shape, dtype) in header.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if name.endswith(".weight_g"):
            name = name[: -len("weight_g")] + "parametrizations.weight.original0"
        elif name.endswith(".weight_v"):
            name = name[: -len("weight_v")] + "parametrizations.weight.original1"
        elif name.startswith("quantizer.quantizers.") and name.endswith(".codebook.weight"):
            name = name[: -len("weight")] + "embed"
        if name in _DROPPED:
            continue
        if name in tensors:
            raise ValueError(f"codec keys {tensors[name][0]!r} and {key!r} both name {name!r}")
        tensors[name] = (key, file, shape, dtype)
    return CodecSource(path=path, config=config, tensors=tensors, kind=kind)


def check_keys(shapes: Mapping[str, tuple[tuple[int, ...], str]], config, encoder: bool) -> None:
    """Check model-named ``{name: (shape, safetensors dtype)}`` against the codec layout; one error for all.

    Decoding requires the quantizer's codebooks and output projections, ``fc2`` and the acoustic decoder;
    ``encoder=True`` also requires the encoder parts. Training-only tensors may be present (and are then
    shape-checked) or absent; anything else is unexpected.
    """
    required = expected_shapes(config, encoder)
    allowed = expected_shapes(config, True) | unused_shapes(config)
    missing = sorted(k for k in required if k not in shapes)
    unexpected = sorted(k for k in shapes if k not in allowed)
    misshaped = sorted(
        f"{k} {list(shape)} (expected {list(allowed[k])})"
        for k, (shape, _) in shapes.items()
        if k in allowed and tuple(shape) != allowed[k]
    )
    not_float = sorted(
        f"{k} ({dtype})" for k, (_, dtype) in shapes.items() if k in allowed and dtype not in _FLOAT_DTYPES
    )
    problems = [
        _listing(f"{len(missing)} missing", missing),
        _listing(f"{len(unexpected)} unexpected", unexpected),
        _listing(f"{len(misshaped)} mis-shaped", misshaped),
        _listing(f"{len(not_float)} non-float", not_float),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise ValueError("codec weights do not match the codec config: " + "; ".join(problems))


def _listing(what: str, names: list[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:_LISTED])
    more = f", ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else ""
    return f"{what} key(s): {shown}{more}"


def expected_shapes(config, encoder: bool) -> dict[str, tuple[int, ...]]:
    """Model name -> shape of every tensor the model (decode-only or full) holds, from a meta-device build."""
    key = (json.dumps(config.to_dict(), sort_keys=True, default=str), encoder)
    if key not in _SHAPES:
        with torch.device("meta"):
            model = CodecModel(config, encoder=encoder)
        if len(_SHAPES) >= 8:
            _SHAPES.pop(next(iter(_SHAPES)))
        _SHAPES[key] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return dict(_SHAPES[key])


_SHAPES: dict[tuple[str, bool], dict[str, tuple[int, ...]]] = {}  # meta builds cost ~20-60 ms each


def load_model(source: CodecSource, encoder: bool, device: torch.device, dtype: torch.dtype) -> CodecModel:
    """Validate ``source`` from its headers, read the tensors the model needs and assemble the model."""
    where = f"{source.kind} {source.path}"
    try:
        check_keys({k: (shape, dt) for k, (_, _, shape, dt) in source.tensors.items()}, source.config, encoder)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    needed = expected_shapes(source.config, encoder)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name in needed:
        key, file, _, _ = source.tensors[name]
        by_file.setdefault(file, []).append((name, key))
    tensors: dict[str, torch.Tensor] = {}
    for file, items in by_file.items():
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name, key in items:
                tensors[name] = f.get_tensor(key)
    return assemble(tensors, source.config, encoder, device, dtype, where=where)


@torch.no_grad()
def assemble(
    tensors: Mapping[str, torch.Tensor],
    config,
    encoder: bool,
    device: torch.device,
    dtype: torch.dtype,
    where: str = "codec weights",
) -> CodecModel:
    """A ``CodecModel`` holding ``tensors`` (model names; extra training-only ones are ignored), checked first.

    The quantizer stays float32 (upstream keeps the RVQ sum in fp32); everything else is cast to ``dtype``.
    """
    try:
        check_keys({k: (tuple(v.shape), _st_dtype(v)) for k, v in tensors.items()}, config, encoder)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    with torch.device("meta"):
        model = CodecModel(config, encoder=encoder)
    state = {}
    for name in model.state_dict():
        tensor = tensors[name]
        # amax/amin propagate NaN and keep inf without a temporary the size of the tensor
        if tensor.numel() and not bool(torch.isfinite(torch.stack([tensor.amax(), tensor.amin()]).float()).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{where}: codec tensor {name!r} holds {bad} non-finite value(s) (NaN/inf)")
        want = torch.float32 if name.startswith("quantizer.") else dtype
        state[name] = tensor.to(device=device, dtype=want)
    model.load_state_dict(state, strict=True, assign=True)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"codec tensors not filled by its state dict: {leftover}"
    return model.eval().requires_grad_(False)


def _st_dtype(tensor: torch.Tensor) -> str:
    return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}.get(
        tensor.dtype, str(tensor.dtype)
    )
