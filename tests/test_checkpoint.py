"""Checkpoint key mapping, strict validation and loading (SPEC 1.2)."""

from __future__ import annotations

import json

import pytest
import torch

from higgs_talker import checkpoint as ckpt
from higgs_talker.api import HiggsTalker, SamplingParams
from higgs_talker.checkpoint import (
    CODEC_PREFIX,
    INDEX_FILE,
    SINGLE_FILE,
    Target,
    expected_shapes,
    export_state,
    iter_tensors,
    load_into,
    map_key,
    save_checkpoint,
)
from higgs_talker.model import TalkerModel
from higgs_talker.tiny import tiny_config, tiny_weights

TIED = tiny_config()
UNTIED = tiny_config(tie_modality_embeddings=False, text={"tie_word_embeddings": False})
BIASED = tiny_config(text={"attention_bias": True, "num_hidden_layers": 2})


def fresh_model(cfg, seed: int = 123) -> TalkerModel:
    """A model whose parameters hold known random values (torch.empty may hold NaNs, which never compare equal)."""
    model = TalkerModel(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"parameter {k} was modified by a failed load"


def load_dir(path, cfg, model=None) -> TalkerModel:
    model = model or fresh_model(cfg)
    load_into(model, iter_tensors(path, cfg), cfg)
    return model


# --------------------------------------------------------------------------------------------- map_key


@pytest.mark.parametrize(
    "key, target",
    [
        ("tied.embedding.text_embedding.weight", Target("model.embed_tokens.weight")),
        ("body.norm.weight", Target("model.norm.weight")),
        ("body.layers.0.input_layernorm.weight", Target("model.layers.0.input_layernorm.weight")),
        ("body.layers.2.post_attention_layernorm.weight", Target("model.layers.2.post_attention_layernorm.weight")),
        ("body.layers.1.self_attn.o_proj.weight", Target("model.layers.1.self_attn.o_proj.weight")),
        ("body.layers.1.self_attn.q_norm.weight", Target("model.layers.1.self_attn.q_norm.weight")),
        ("body.layers.1.self_attn.k_norm.weight", Target("model.layers.1.self_attn.k_norm.weight")),
        ("body.layers.1.mlp.down_proj.weight", Target("model.layers.1.mlp.down_proj.weight")),
        ("body.layers.0.self_attn.q_proj.weight", Target("model.layers.0.self_attn.qkv_proj.weight", 0)),
        ("body.layers.0.self_attn.k_proj.weight", Target("model.layers.0.self_attn.qkv_proj.weight", 1)),
        ("body.layers.0.self_attn.v_proj.weight", Target("model.layers.0.self_attn.qkv_proj.weight", 2)),
        ("body.layers.11.self_attn.q_proj.bias", Target("model.layers.11.self_attn.qkv_proj.bias", 0)),
        ("body.layers.11.self_attn.v_proj.bias", Target("model.layers.11.self_attn.qkv_proj.bias", 2)),
        ("body.layers.3.mlp.gate_proj.weight", Target("model.layers.3.mlp.gate_up_proj.weight", 0)),
        ("body.layers.3.mlp.up_proj.weight", Target("model.layers.3.mlp.gate_up_proj.weight", 1)),
        ("tied.embedding.modality_embeddings.0.embedding.weight", Target("multimodal_embedding.weight")),
        (f"{CODEC_PREFIX}quantizer.codebook.weight", None),
        (f"{CODEC_PREFIX}decoder.conv.weight", None),
        (f"{CODEC_PREFIX}embedding.weight", None),  # the codec shares a stem with the fused table
        ("tied.head.text_head.weight", None),  # tied: lm_head is embed_tokens
        ("tied.head.modality_heads.0.weight", None),  # tied: the head is the fused table
    ],
)
def test_map_key_tied(key, target):
    assert map_key(key, TIED) == target


def test_map_key_untied_heads_load():
    assert map_key("tied.head.text_head.weight", UNTIED) == Target("lm_head.weight")
    assert map_key("tied.head.modality_heads.0.weight", UNTIED) == Target("modality_head.weight")
    assert map_key(f"{CODEC_PREFIX}x.weight", UNTIED) is None


@pytest.mark.parametrize(
    "key",
    ["model.embed_tokens.weight", "lm_head.weight", "body.final_norm.weight", "tied.embedding.other.weight", ""],
)
def test_map_key_unknown_prefix_raises(key):
    with pytest.raises(ValueError, match="unexpected checkpoint key"):
        map_key(key, TIED)


def test_expected_shapes_required_set():
    # SPEC 1.2: 3 global keys + 11 per layer (399 for 36 layers); optional heads only when untied
    assert len(expected_shapes(TIED)) == 3 + 11 * TIED.text.num_hidden_layers
    assert len(expected_shapes(UNTIED)) == 3 + 11 * UNTIED.text.num_hidden_layers + 2
    assert len(expected_shapes(BIASED)) == 3 + 14 * BIASED.text.num_hidden_layers
    shapes = expected_shapes(TIED)
    t = TIED.text
    assert shapes["tied.embedding.modality_embeddings.0.embedding.weight"] == (8 * 1026, t.hidden_size)
    assert shapes["body.layers.0.self_attn.q_proj.weight"] == (t.num_attention_heads * t.head_dim, t.hidden_size)
    assert shapes["body.layers.0.self_attn.o_proj.weight"] == (t.hidden_size, t.num_attention_heads * t.head_dim)


# --------------------------------------------------------------------------------------------- good loads


@pytest.mark.parametrize("cfg", [TIED, UNTIED, BIASED], ids=["tied", "untied", "bias"])
def test_load_places_every_tensor(tmp_path, cfg):
    """Each checkpoint tensor lands where it belongs, packed shards in q|k|v and gate|up order."""
    weights = tiny_weights(cfg, seed=5)
    save_checkpoint(weights, tmp_path)
    model = load_dir(tmp_path, cfg)
    params = dict(model.named_parameters())
    t = cfg.text
    q, kv, inter = t.q_size, t.kv_size, t.intermediate_size
    for i in range(t.num_hidden_layers):
        p, w = f"model.layers.{i}.", f"body.layers.{i}."
        qkv = params[p + "self_attn.qkv_proj.weight"]
        assert torch.equal(qkv[:q], weights[w + "self_attn.q_proj.weight"])
        assert torch.equal(qkv[q : q + kv], weights[w + "self_attn.k_proj.weight"])
        assert torch.equal(qkv[q + kv :], weights[w + "self_attn.v_proj.weight"])
        gate_up = params[p + "mlp.gate_up_proj.weight"]
        assert torch.equal(gate_up[:inter], weights[w + "mlp.gate_proj.weight"])
        assert torch.equal(gate_up[inter:], weights[w + "mlp.up_proj.weight"])
        if t.attention_bias:
            bias = params[p + "self_attn.qkv_proj.bias"]
            cat = [weights[w + f"self_attn.{n}_proj.bias"] for n in "qkv"]
            assert torch.equal(bias, torch.cat(cat))
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            assert torch.equal(params[p + name + ".weight"], weights[w + name + ".weight"])
        assert torch.equal(params[p + "self_attn.o_proj.weight"], weights[w + "self_attn.o_proj.weight"])
        assert torch.equal(params[p + "mlp.down_proj.weight"], weights[w + "mlp.down_proj.weight"])
    assert torch.equal(model.model.embed_tokens.weight, weights["tied.embedding.text_embedding.weight"])
    assert torch.equal(model.model.norm.weight, weights["body.norm.weight"])
    table = weights["tied.embedding.modality_embeddings.0.embedding.weight"]
    assert torch.equal(model.multimodal_embedding.weight, table)
    if cfg.tie_modality_embeddings:
        assert model.modality_head.weight is model.multimodal_embedding.weight
    else:
        assert torch.equal(model.modality_head.weight, weights["tied.head.modality_heads.0.weight"])
        assert model.modality_head.weight.data_ptr() != model.multimodal_embedding.weight.data_ptr()
        assert not torch.equal(model.modality_head.weight, table)
    if cfg.text.tie_word_embeddings:
        assert not hasattr(model, "lm_head")
        assert model.text_head_weight is model.model.embed_tokens.weight
    else:
        assert torch.equal(model.lm_head.weight, weights["tied.head.text_head.weight"])
        assert model.text_head_weight is model.lm_head.weight


def test_codec_keys_are_never_read(tmp_path):
    save_checkpoint(tiny_weights(TIED), tmp_path)
    keys = [k for k, _ in iter_tensors(tmp_path, TIED)]
    assert keys and not any(k.startswith(CODEC_PREFIX) for k in keys)
    assert set(keys) == set(expected_shapes(TIED))


def test_tied_head_tensor_in_checkpoint_is_skipped(tmp_path):
    """A checkpoint that also stores the (tied) heads loads; the extra tensors are ignored, not copied."""
    weights = tiny_weights(TIED)
    weights["tied.head.text_head.weight"] = torch.zeros_like(weights["tied.embedding.text_embedding.weight"])
    weights["tied.head.modality_heads.0.weight"] = torch.zeros(8 * 1026, TIED.text.hidden_size)
    save_checkpoint(weights, tmp_path)
    model = load_dir(tmp_path, TIED)
    table = weights["tied.embedding.modality_embeddings.0.embedding.weight"]
    assert torch.equal(model.multimodal_embedding.weight, table)
    assert model.model.embed_tokens.weight.abs().sum() > 0


@pytest.mark.parametrize("cfg", [TIED, UNTIED, BIASED], ids=["tied", "untied", "bias"])
@pytest.mark.parametrize("shards", [1, 3])
def test_export_save_reload_round_trip(tmp_path, cfg, shards):
    model = fresh_model(cfg, seed=7)
    state = export_state(model, cfg)
    assert set(state) == set(expected_shapes(cfg))
    save_checkpoint(state, tmp_path, shards=shards)
    if shards > 1:
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert len(set(index["weight_map"].values())) == shards
        assert not (tmp_path / SINGLE_FILE).exists()
    again = load_dir(tmp_path, cfg, fresh_model(cfg, seed=8))
    before, after = dict(model.named_parameters()), dict(again.named_parameters())
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize(
    "cfg",
    [
        tiny_config(tie_modality_embeddings=False),
        tiny_config(text={"tie_word_embeddings": False}),
    ],
    ids=["untied_modality", "untied_text"],
)
def test_untied_checkpoints_load_through_the_api(make_checkpoint, cfg):
    path = make_checkpoint(cfg, shards=2)
    talker = HiggsTalker.from_pretrained(path, max_num_seqs=2, max_model_len=64)
    m = talker.model
    assert (m.modality_head.weight is m.multimodal_embedding.weight) == cfg.tie_modality_embeddings
    assert (m.text_head_weight is m.model.embed_tokens.weight) == cfg.text.tie_word_embeddings
    out = talker.generate("hi", SamplingParams(seed=0, min_frames=3), max_frames=3)  # min: no early EOC
    assert out.codes.shape == (3, 8) and out.rows.shape == (3 + 8, 8)


# --------------------------------------------------------------------------------------------- bad checkpoints


def test_missing_keys_are_listed_in_one_error(tmp_path):
    weights = tiny_weights(TIED)
    gone = ["body.layers.1.mlp.up_proj.weight", "body.norm.weight", "body.layers.2.self_attn.k_norm.weight"]
    for k in gone:
        del weights[k]
    save_checkpoint(weights, tmp_path)
    with pytest.raises(ValueError, match="missing 3 required key") as err:
        load_dir(tmp_path, TIED)
    for k in gone:
        assert k in str(err.value)


def test_unexpected_key(tmp_path):
    weights = tiny_weights(TIED)
    weights["body.layers.0.self_attn.rotary.inv_freq"] = torch.zeros(4)
    weights["vision_tower.weight"] = torch.zeros(2)
    save_checkpoint(weights, tmp_path)
    with pytest.raises(ValueError, match="vision_tower.weight"):
        load_dir(tmp_path, TIED)


def test_key_not_needed_by_this_config(tmp_path):
    """A bias tensor while attention_bias is false maps to a real parameter name but must be refused."""
    weights = tiny_weights(TIED)
    weights["body.layers.0.self_attn.q_proj.bias"] = torch.zeros(TIED.text.q_size)
    save_checkpoint(weights, tmp_path)
    with pytest.raises(ValueError, match=r"body\.layers\.0\.self_attn\.q_proj\.bias"):
        load_dir(tmp_path, TIED)


def test_wrong_shape_names_key_and_both_shapes(tmp_path):
    weights = tiny_weights(TIED)
    key = "body.layers.1.mlp.gate_proj.weight"
    weights[key] = torch.zeros(100, TIED.text.hidden_size)
    save_checkpoint(weights, tmp_path)
    with pytest.raises(ValueError) as err:
        load_dir(tmp_path, TIED)
    msg = str(err.value)
    assert key in msg and "[100, 64]" in msg and f"[{TIED.text.intermediate_size}, 64]" in msg


def test_wrong_codebook_table_shape(tmp_path):
    weights = tiny_weights(TIED)
    key = "tied.embedding.modality_embeddings.0.embedding.weight"
    weights[key] = weights[key][:-1]
    save_checkpoint(weights, tmp_path)
    with pytest.raises(ValueError, match=r"\[8207, 64\].*\[8208, 64\]"):
        load_dir(tmp_path, TIED)


def test_int_dtype_tensor(tmp_path):
    weights = tiny_weights(TIED)
    key = "body.layers.0.input_layernorm.weight"
    weights[key] = weights[key].to(torch.int32)
    save_checkpoint(weights, tmp_path)
    with pytest.raises(ValueError, match=rf"{key}.*dtype I32"):
        load_dir(tmp_path, TIED)


def test_bf16_checkpoint_loads_into_fp32(tmp_path):
    weights = {k: v.to(torch.bfloat16) for k, v in tiny_weights(TIED).items()}
    save_checkpoint(weights, tmp_path)
    model = fresh_model(TIED)
    load_into(model, iter_tensors(tmp_path, TIED, dtype=torch.float32), TIED)
    assert model.model.norm.weight.dtype == torch.float32
    assert torch.equal(model.model.norm.weight, weights["body.norm.weight"].float())


def test_sharded_index_names_missing_shard(tmp_path):
    save_checkpoint(tiny_weights(TIED), tmp_path, shards=3)
    victim = "model-00002-of-00003.safetensors"
    (tmp_path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim):
        load_dir(tmp_path, TIED)


def test_sharded_index_without_weight_map(tmp_path):
    save_checkpoint(tiny_weights(TIED), tmp_path, shards=2)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        load_dir(tmp_path, TIED)


def test_key_in_two_shards(tmp_path):
    weights = tiny_weights(TIED)
    save_checkpoint(weights, tmp_path)
    save_checkpoint({"body.norm.weight": weights["body.norm.weight"]}, tmp_path / "extra")
    (tmp_path / "extra" / SINGLE_FILE).rename(tmp_path / "zz.safetensors")
    files = [tmp_path / SINGLE_FILE, tmp_path / "zz.safetensors"]
    with pytest.raises(ValueError, match=r"body\.norm\.weight.*appears in both"):
        ckpt.read_header(files)


def test_only_pickle_checkpoint_is_refused(tmp_path):
    torch.save({"body.norm.weight": torch.ones(64)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(TIED.to_dict()))
    with pytest.raises(ValueError, match=r"pickle.*pytorch_model\.bin.*safetensors"):
        load_dir(tmp_path, TIED)


def test_empty_dir_and_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        load_dir(tmp_path, TIED)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dir(tmp_path / "nope", TIED)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .safetensors file"):
        ckpt.checkpoint_files(tmp_path / "weights.bin")


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "header_only"])
def test_corrupt_safetensors(tmp_path, how):
    save_checkpoint(tiny_weights(TIED), tmp_path)
    path = tmp_path / SINGLE_FILE
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"\x13\x37" * 1000)
    elif how == "empty":
        path.write_bytes(b"")
    else:  # a valid-looking length prefix followed by too few header bytes
        path.write_bytes(data[:12])
    model = fresh_model(TIED)
    before = snapshot(model)
    with pytest.raises(ValueError, match=SINGLE_FILE):
        load_dir(tmp_path, TIED, model)
    assert_unchanged(model, before)


# --------------------------------------------------------------------------------------------- nothing half-loaded


def _good_items(cfg):
    return list(tiny_weights(cfg, seed=3).items())


@pytest.mark.parametrize("where", ["first", "last"])
def test_failed_load_into_leaves_model_unchanged_wrong_shape(where):
    items = _good_items(TIED)
    idx = 0 if where == "first" else len(items) - 1
    key, value = items[idx]
    items[idx] = (key, torch.zeros(*[s + 1 for s in value.shape]))
    model = fresh_model(TIED)
    before = snapshot(model)
    with pytest.raises(ValueError, match="shape"):
        load_into(model, iter(items), TIED)
    assert_unchanged(model, before)


def test_failed_load_into_leaves_model_unchanged_missing():
    items = [(k, v) for k, v in _good_items(TIED) if k != "body.layers.2.self_attn.v_proj.weight"]
    model = fresh_model(TIED)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.qkv_proj\.weight"):
        load_into(model, iter(items), TIED)
    assert_unchanged(model, before)


def test_failed_load_into_leaves_model_unchanged_unexpected_key_late():
    items = [*_good_items(TIED), ("surprise.weight", torch.zeros(3))]
    model = fresh_model(TIED)
    before = snapshot(model)
    with pytest.raises(ValueError, match="surprise.weight"):
        load_into(model, iter(items), TIED)
    assert_unchanged(model, before)


def test_failed_load_into_leaves_model_unchanged_duplicate_shard():
    items = _good_items(TIED)
    items.append(("body.layers.0.self_attn.k_proj.weight", dict(items)["body.layers.0.self_attn.k_proj.weight"]))
    model = fresh_model(TIED)
    before = snapshot(model)
    with pytest.raises(ValueError, match="twice"):
        load_into(model, iter(items), TIED)
    assert_unchanged(model, before)


def test_failed_disk_load_leaves_model_unchanged(tmp_path):
    weights = tiny_weights(TIED)
    weights["body.layers.2.mlp.down_proj.weight"] = torch.zeros(3, 3)  # last layer: most tensors precede it
    save_checkpoint(weights, tmp_path, shards=2)
    model = fresh_model(TIED)
    before = snapshot(model)
    with pytest.raises(ValueError, match="down_proj"):
        load_dir(tmp_path, TIED, model)
    assert_unchanged(model, before)


def test_load_into_returns_the_filled_parameter_names():
    model = fresh_model(TIED)
    names = load_into(model, iter(_good_items(TIED)), TIED)
    assert names == {n for n, _ in model.named_parameters()}


def test_the_router_alone_refuses_an_untied_checkpoint_without_its_text_head():
    """The vLLM adapter's load_weights has only ``WeightRouter.finish()`` (no header check before it): an untied
    checkpoint that lacks its text head must fail there, naming the key and the parameter left unfilled, not load
    with an uninitialised text head."""
    cfg = tiny_config(text={"tie_word_embeddings": False})
    model = TalkerModel(cfg)
    router = ckpt.WeightRouter(dict(model.named_parameters()), cfg)
    for key, tensor in tiny_weights(cfg, codec=False).items():
        if key != ckpt.TEXT_HEAD_KEY:
            router.route(key, tensor)
    with pytest.raises(ValueError, match=r"tied\.head\.text_head\.weight.*does not fill model parameter\(s\): lm_head"):
        router.finish()


def test_loading_logs_its_phases(tiny_dir, caplog) -> None:
    """``from_pretrained`` says how long building the model and reading its weights took, and how much it read (the
    warm-start figures' split, bench_coldstart's phases)."""
    import logging
    import re

    with caplog.at_level(logging.INFO, logger="higgs_talker.api"):
        talker = HiggsTalker.from_pretrained(tiny_dir, codec=False)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded "))
    found = re.search(r"model and kernels ([\d.]+) s, weights \(([\d.]+) MB read, checked, copied\) ([\d.]+) s", line)
    assert found, line
    nbytes = sum(p.numel() * p.element_size() for p in talker.model.parameters())
    assert float(found.group(2)) == round(nbytes / 1e6, 1)


def test_loading_a_checkpoint_never_imports_torch_dynamo_or_sympy(tiny_dir):
    """The model is built on the meta device; any arithmetic there (a default ``normal_`` init, a RoPE table, an
    ``arange`` times a size, ``empty_like`` in ``to_empty``) runs torch's Python reference ops, which import sympy
    and ``torch._dynamo`` with FSDP (on the H100 image, which keeps no bytecode caches, a profiled warm 4B start
    spent 9.3 s in that import chain, h100_20261205). Load, decode a few frames (no codec: transformers' modeling
    code imports both), and check neither was imported."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from higgs_talker import HiggsTalker, SamplingParams\n"
        f"t = HiggsTalker.from_pretrained({str(tiny_dir)!r}, codec=False)\n"
        "rows = t.generate('a few frames', SamplingParams(seed=3, max_frames=12)).codes\n"
        "print(int(rows.shape[0]), [m for m in ('torch._dynamo', 'sympy') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["12", "[]"], out
