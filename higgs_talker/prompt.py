"""Tokenizer, special tokens and prompt building (SPEC 1.3, 3.1-3.2).

Plain TTS:            ``[<|tts|>, <|text|>] + enc(text) + [<|audio|>]``
Voice clone:          ``[<|tts|>, <|ref_audio|>] + [P] * R + [<|text|>] + enc(text) + [<|audio|>]``
Voice clone + text:   ``[<|tts|>, <|ref_text|>] + enc(ref_text) + [<|ref_audio|>] + [P] * R + ...``

``R = T + C - 1`` placeholders carry the reference codes ``[T, C]`` with the delay pattern applied; each
placeholder id is ``<|tts|>`` (a valid id that can never look like ``<|audio|>``) and its embedding is replaced
by the fused codebook embedding of its row at prefill. The prompt always ends with ``<|audio|>``.

Because the placeholder ids are the same for every voice, a prefix cache keyed on token ids alone would hand one
voice's K/V to another: the direct engine's cache keys each block on the rows in it too
(``kv_cache.prefix_hashes``), and ``Prompt.vllm_prompt`` gives vLLM a ``cache_salt`` naming the rows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .config import OPTIONAL_SPECIAL_TOKENS, REQUIRED_SPECIAL_TOKENS, SpecialTokens, TalkerConfig, register_hf_config
from .heads.delay import apply_delay_pattern


class PromptTooLong(ValueError):
    """A prompt that leaves no room to generate: past the model's positions, or the engine's max_model_len or KV
    cache (``scheduler``)."""


@dataclass(frozen=True)
class Prompt:
    """A built prompt: token ids and the delayed reference rows that replace placeholder embeddings."""

    input_ids: Tensor  # [T] int64
    audio_codes: Tensor | None = None  # [R, C] int64 delayed reference rows
    audio_positions: Tensor | None = None  # [R] int64 prompt positions of the placeholders

    def __post_init__(self) -> None:
        # Structural checks only (the vocabulary range needs the config): a malformed prompt must fail here,
        # not in the middle of an engine step.
        ids = self.input_ids
        if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            what = f"{ids.dtype} {list(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
            raise TypeError(f"Prompt.input_ids must be a 1-D integer tensor, got {what}")
        if ids.numel() == 0:
            raise ValueError("Prompt.input_ids is empty")
        if int(ids.min()) < 0:
            raise ValueError(f"Prompt.input_ids holds the negative id {int(ids.min())}")
        codes, positions = self.audio_codes, self.audio_positions
        if (codes is None) != (positions is None):
            raise ValueError("Prompt.audio_codes and Prompt.audio_positions must be given together")
        if codes is not None:
            if codes.dim() != 2 or positions.dim() != 1 or codes.shape[0] != positions.shape[0]:
                raise ValueError(
                    f"Prompt.audio_codes [R, C] and audio_positions [R] disagree: {list(codes.shape)} vs "
                    f"{list(positions.shape)}"
                )
            lo, hi = (int(positions.min()), int(positions.max())) if positions.numel() else (0, 0)
            if lo < 0 or hi >= ids.numel():
                raise ValueError(f"Prompt.audio_positions must lie in [0, {ids.numel()}), got {lo}..{hi}")

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    def reference_digest(self) -> str | None:
        """32 hex chars (blake2b-128) naming the reference rows [R, C] and their positions [R], or None for a prompt
        without reference rows. Stable across processes, machines and releases of torch: it hashes the shape and
        the values as little-endian int64 (never Python's ``hash()``), so equal rows at equal positions give equal
        digests and any changed code or position another one."""
        codes, positions = self.audio_codes, self.audio_positions
        if codes is None or codes.shape[0] == 0:
            return None
        h = hashlib.blake2b(digest_size=16, person=b"higgs-ref-rows1")
        for t in (torch.tensor(codes.shape), positions, codes):
            h.update(t.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes())
        return h.hexdigest()

    def vllm_prompt(self) -> dict:
        """The prompt as vLLM takes it (a ``vllm.inputs.TokensPrompt``): ``{"prompt_token_ids": [T ints]}``, plus
        ``"cache_salt": reference_digest()`` when reference rows replace placeholder embeddings. vLLM's prefix cache
        hashes token ids and the salt only, and the placeholders' ids do not depend on the voice: without the salt
        a clone would reuse the K/V of an earlier voice of the same length. The salt names the rows, not the text,
        so requests with the same voice still share their reference blocks, and plain prompts keep sharing."""
        out: dict = {"prompt_token_ids": self.input_ids.tolist()}
        salt = self.reference_digest()
        if salt is not None:
            out["cache_salt"] = salt
        return out


def validate_prompt(prompt: Prompt, cfg: TalkerConfig) -> None:
    """Check a (possibly hand-built) prompt against the model before it is queued, so that a bad one fails its
    own ``add_request`` instead of a later step shared with other requests."""
    if not isinstance(prompt, Prompt):
        raise TypeError(f"prompt must be a Prompt (see HiggsTalker.build_prompt), got {type(prompt).__name__}")
    ids, vocab = prompt.input_ids, cfg.text.vocab_size
    if int(ids.max()) >= vocab:
        raise ValueError(f"prompt token id {int(ids.max())} is outside the text vocabulary [0, {vocab})")
    codes = prompt.audio_codes
    if codes is None:
        return
    if not isinstance(codes, Tensor) or codes.dtype.is_floating_point or codes.dtype == torch.bool:
        what = codes.dtype if isinstance(codes, Tensor) else type(codes).__name__
        raise TypeError(f"Prompt.audio_codes must be an integer tensor [rows, {cfg.num_codebooks}], got {what}")
    if codes.shape[1] != cfg.num_codebooks:
        raise ValueError(f"Prompt.audio_codes must have {cfg.num_codebooks} codebooks, got shape {list(codes.shape)}")
    if codes.numel():
        lo, hi = int(codes.long().min()), int(codes.long().max())
        if lo < 0 or hi >= cfg.codebook_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"Prompt.audio_codes holds code {bad}, outside the codebook [0, {cfg.codebook_size})")


class TalkerTokenizer:
    """The checkpoint's tokenizer (transformers, no remote code) and its resolved special ids."""

    def __init__(self, tokenizer, specials: SpecialTokens, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.specials = specials
        self.max_length = max_length
        self._special_strings = tuple(tokenizer.get_added_vocab())

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: TalkerConfig) -> TalkerTokenizer:
        try:
            named = _named_tokenizer_class(Path(path))
            if named is not None:
                tok = named.from_pretrained(str(path))
            else:
                from transformers import AutoTokenizer

                register_hf_config()  # AutoTokenizer reads config.json; let it know our model_type
                tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        except Exception as exc:  # tokenizers raises plain Exception (and KeyError, ...) for a malformed file
            if not (Path(path) / "tokenizer.json").is_file():  # transformers' own message is about sentencepiece
                raise ValueError(
                    f"could not load a tokenizer from {str(path)!r}: it has no tokenizer.json (a checkpoint carries "
                    "its tokenizer in that file: copy it from the original checkpoint)"
                ) from exc
            raise ValueError(f"could not load a tokenizer from {path}: {type(exc).__name__}: {exc}") from exc
        return cls(tok, resolve_special_tokens(tok, cfg), cfg.text.max_position_embeddings)

    def encode(self, text: str) -> list[int]:
        # verbose=False: past model_max_length transformers warns of "indexing errors"; _finish refuses such prompts
        return self.tokenizer.encode(text, add_special_tokens=False, verbose=False)

    def build(
        self,
        text: str,
        reference_codes: Tensor | None = None,
        reference_text: str | None = None,
        cfg: TalkerConfig | None = None,
    ) -> Prompt:
        """Token ids for ``text`` (and an optional reference voice given as aligned codes [T, C])."""
        text = _check_text(text, "text", self._special_strings)
        sp = self.specials
        body = [sp.text, *self.encode(text), sp.audio]
        if reference_codes is None:
            if reference_text is not None:
                raise ValueError("reference_text was given without reference codes")
            ids = [sp.tts, *body]
            return self._finish(Prompt(torch.tensor(ids, dtype=torch.long)))
        if cfg is None:
            raise ValueError("building a voice-clone prompt needs the TalkerConfig")
        if sp.ref_audio is None:
            raise ValueError("this tokenizer has no <|ref_audio|> token, so voice cloning is not available")
        rows = apply_delay_pattern(check_reference_codes(reference_codes, cfg), cfg.boc_id, cfg.eoc_id)
        head = [sp.tts]
        if reference_text is not None:
            ref_text = _check_text(reference_text, "reference_text", self._special_strings)
            if sp.ref_text is None:
                raise ValueError("this tokenizer has no <|ref_text|> token; pass reference_text=None")
            head += [sp.ref_text, *self.encode(ref_text)]
        head.append(sp.ref_audio)
        start = len(head)
        ids = head + [sp.tts] * rows.shape[0] + body
        positions = torch.arange(start, start + rows.shape[0], dtype=torch.long)
        return self._finish(Prompt(torch.tensor(ids, dtype=torch.long), rows, positions))

    def _finish(self, prompt: Prompt) -> Prompt:
        if len(prompt) >= self.max_length:
            raise PromptTooLong(
                f"prompt is {len(prompt)} tokens; the model's maximum length is {self.max_length} "
                "(max_position_embeddings), which must also leave room for the generated frames"
            )
        return prompt


def _named_tokenizer_class(path: Path) -> type | None:
    """The transformers tokenizer class that ``tokenizer_config.json`` names, where that choice is plain: no
    ``auto_map`` (custom code) in it or in ``config.json``, a class transformers exports, and not the Llama name that
    AutoTokenizer second-guesses against the file's pre-tokenizer. None sends the load through AutoTokenizer.

    Why not always AutoTokenizer: importing it (transformers 5.17, the H100/H200 image) imports transformers'
    model-class registry, and with it the generation and modeling code, torch's DTensor ops, sympy and
    torch._dynamo: 9.3 s of a profiled warm start there (``h100_20261205``, traced in ``h100_20261205b``). In the
    plain case AutoTokenizer would pick this same class (``test_prompt`` checks the two give the same tokenizer)."""
    files = [_json_dict(path / name) for name in ("tokenizer_config.json", "config.json")]
    name = files[0].get("tokenizer_class")
    if any("auto_map" in f for f in files) or not isinstance(name, str):
        return None
    if name.removesuffix("Fast") == "LlamaTokenizer":
        return None
    import transformers
    from transformers import PreTrainedTokenizerBase, TokenizersBackend

    if name in ("PreTrainedTokenizerFast", "TokenizersBackend", "PythonBackend"):
        return TokenizersBackend
    found = getattr(transformers, name, None)
    if not (isinstance(found, type) and issubclass(found, PreTrainedTokenizerBase)):
        return None
    return found


def _json_dict(path: Path) -> dict:
    """A JSON file's object, or an empty dict where the file is missing or not an object."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def resolve_special_tokens(tokenizer, cfg: TalkerConfig) -> SpecialTokens:
    """Look the special tokens up in the tokenizer's added vocabulary; the required ones must exist."""
    added = tokenizer.get_added_vocab()
    missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in added]
    if missing:
        raise ValueError(f"tokenizer lacks required special token(s) {', '.join(missing)}")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else cfg.eos_token_id
    if eos is None:
        raise ValueError("neither the tokenizer nor config.json defines an eos token id")
    opt = {t: added.get(t) for t in OPTIONAL_SPECIAL_TOKENS}
    ids = SpecialTokens(
        tts=added["<|tts|>"],
        text=added["<|text|>"],
        audio=added["<|audio|>"],
        eos=int(eos),
        ref_audio=opt["<|ref_audio|>"],
        ref_text=opt["<|ref_text|>"],
    )
    vocab = cfg.text.vocab_size
    for name in ("tts", "text", "audio", "eos", "ref_audio", "ref_text"):
        value = getattr(ids, name)
        if value is not None and not 0 <= value < vocab:
            raise ValueError(f"special token {name} has id {value}, outside the text vocabulary [0, {vocab})")
    return ids


def check_reference_codes(codes, cfg: TalkerConfig) -> Tensor:
    """Validate aligned reference codes: [T, C] integers, T >= 1, each a real code in [0, num_real_codes)."""
    if not isinstance(codes, Tensor):
        try:
            codes = torch.as_tensor(codes)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"reference codes must be an integer array [frames, {cfg.num_codebooks}]: {exc}") from exc
    if codes.dtype.is_floating_point or codes.dtype == torch.bool or codes.is_complex():
        raise ValueError(f"reference codes must be integers, got dtype {codes.dtype}")
    n = cfg.num_codebooks
    if codes.dim() != 2 or codes.shape[1] != n or codes.shape[0] == 0:
        raise ValueError(f"reference codes must have shape [frames >= 1, {n}], got {list(codes.shape)}")
    if codes.dtype in (torch.uint16, torch.uint32, torch.uint64):
        # torch has no min/max for these; a uint64 above 2**63 wraps negative here and is rejected below
        codes = codes.to(torch.int64)
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi >= cfg.num_real_codes:
        bad = lo if lo < 0 else hi
        raise ValueError(f"reference code {bad} is outside the real code range [0, {cfg.num_real_codes})")
    return codes.long().cpu()


def _check_text(text: str, name: str, specials: tuple[str, ...]) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{name} is empty or whitespace only: {text!r}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (JSON "\ud800"): the tokenizer raised a TypeError
        raise ValueError(
            f"{name} holds {text[exc.start]!r} at index {exc.start}, which is not valid Unicode text"
        ) from None
    for s in specials:
        if s in text:
            raise ValueError(f"{name} contains the special token {s!r}, which would break the prompt layout")
    return text
