"""The backbone against transformers' Qwen3 (the independent reference), through the paged KV cache.

A random fp32 ``transformers`` Qwen3 model is copied into our ``TalkerModel`` through the checkpoint loader
(HF names -> checkpoint names -> ``load_into``), and our final-normed hidden states must equal HF's
``last_hidden_state`` for flat multi-sequence prefill, chunked prefill mixed with decode, and token-by-token
decode through a paged cache whose sequences span several small blocks in scattered order.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from _tolerance import assert_matmul_close, chain_rel_tol, gamma, rel_err
from _tolerance import qwen3_chain as chain_of

from higgs_talker.attention import SdpaAttention, use_backend
from higgs_talker.batch import StepBatch
from higgs_talker.checkpoint import load_into
from higgs_talker.config import MODEL_TYPE, TalkerConfig
from higgs_talker.kv_cache import allocate_kv_caches
from higgs_talker.model import TalkerModel

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
MAX_CONTEXT = 18  # the longest sequence any test below runs (3 + 12 decode steps + slack)


@dataclass(frozen=True)
class Case:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    bias: bool
    tie: bool = True
    theta: float = 5000.0
    inter: int = 96


CASES = {
    # GQA 2:1, q_size == hidden, q/k/v biases
    "gqa_bias": Case(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, bias=True),
    # GQA 2:1, q_size (128) != hidden (64), no bias: the shape of the real checkpoint's attention
    "gqa_wide_heads": Case(hidden=64, heads=4, kv_heads=2, head_dim=32, layers=3, bias=False),
    # MQA (8 query heads share one KV head), untied text head, a large theta
    "mqa_untied": Case(hidden=48, heads=8, kv_heads=1, head_dim=8, layers=2, bias=False, tie=False, theta=1e6),
}


def hf_config(case: Case):
    """A transformers Qwen3Config; RoPE theta given nested (transformers >= 5) or flat (older releases)."""
    kwargs = dict(
        vocab_size=100,
        hidden_size=case.hidden,
        intermediate_size=case.inter,
        num_hidden_layers=case.layers,
        num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads,
        head_dim=case.head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        attention_bias=case.bias,
        tie_word_embeddings=case.tie,
        attn_implementation="eager",
    )
    try:
        cfg = transformers.Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": case.theta}, **kwargs)
    except TypeError:
        cfg = transformers.Qwen3Config(rope_theta=case.theta, **kwargs)
    rope = getattr(cfg, "rope_parameters", None) or {}
    assert rope.get("rope_theta", getattr(cfg, "rope_theta", None)) == case.theta
    return cfg


def hf_to_checkpoint_name(name: str) -> str | None:
    """Qwen3ForCausalLM parameter name -> our checkpoint key."""
    if name == "model.embed_tokens.weight":
        return "tied.embedding.text_embedding.weight"
    if name == "model.norm.weight":
        return "body.norm.weight"
    if name.startswith("model.layers."):
        return "body." + name[len("model.") :]
    if name == "lm_head.weight":
        return "tied.head.text_head.weight"
    raise AssertionError(f"unmapped HF parameter {name}")


@dataclass
class Pair:
    hf: torch.nn.Module
    ours: TalkerModel
    cfg: TalkerConfig
    case: Case


def build_pair(case: Case, seed: int = 0) -> Pair:
    hcfg = hf_config(case)
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(hcfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("o_proj.bias"):
                p.zero_()  # Qwen3 (and vLLM) have no o_proj bias; transformers adds one when attention_bias
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
    # our config parsed from the HF text config itself (nested rope_parameters and all)
    cfg = TalkerConfig.from_dict({"model_type": MODEL_TYPE, "text_config": hcfg.to_dict()})
    assert cfg.text.rope_theta == case.theta
    assert cfg.text.tie_word_embeddings == case.tie
    weights = {}
    for name, p in hf.named_parameters():
        if name.endswith("o_proj.bias"):
            continue
        weights[hf_to_checkpoint_name(name)] = p.detach().clone()
    weights["tied.embedding.modality_embeddings.0.embedding.weight"] = torch.randn(
        cfg.num_codebooks * cfg.codebook_size, cfg.hidden_size, generator=g
    )
    ours = TalkerModel(cfg).eval().requires_grad_(False)
    load_into(ours, weights.items(), cfg)
    return Pair(hf, ours, cfg, case)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def pair(request) -> Pair:
    return build_pair(CASES[request.param])


def hf_hidden(pair: Pair, embeds: torch.Tensor) -> torch.Tensor:
    """HF last_hidden_state of one sequence: embeds [L, H] -> [L, H]."""
    with torch.no_grad():
        out = pair.hf.model(inputs_embeds=embeds[None], use_cache=False)
    return out.last_hidden_state[0]


def qwen3_chain(case: Case, context: int) -> tuple[list[int], int]:
    """The reductions and stored roundings of one forward pass of a ``case`` model (``_tolerance.qwen3_chain``).

    The weights' own roundings count where they are stored in a lower precision than the reference (bf16
    test: 4 matrices + 4 norm vectors per layer); that test adds them itself.
    """
    return chain_of(case.hidden, case.heads, case.head_dim, case.inter, case.layers, context)


def parity_tol(case: Case, context: int = MAX_CONTEXT) -> float:
    """fp32 ours vs fp32 HF: each side is within the chain bound of the exact result, so twice that."""
    reductions, roundings = qwen3_chain(case, context)
    return 2 * chain_rel_tol(reductions, roundings, torch.float32)


@pytest.fixture
def tol(pair) -> float:
    return parity_tol(pair.case)


class PagedRunner:
    """Drives our model the way an engine does: a paged cache, scattered block tables, explicit metadata."""

    def __init__(self, pair: Pair, num_seqs: int, max_len: int, seed: int = 0) -> None:
        t = pair.cfg.text
        self.model = pair.ours
        blocks_per_seq = -(-max_len // BLOCK_SIZE)
        num_blocks = num_seqs * blocks_per_seq + 3
        self.caches = allocate_kv_caches(t, num_blocks, BLOCK_SIZE, torch.float32, "cpu")
        for c in self.caches:  # garbage in unused slots must never be read
            c.normal_()
        self.attn = SdpaAttention(self.caches, t.num_attention_heads, t.num_key_value_heads, t.head_dim, max_len)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables = [perm[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(num_seqs)]
        self.max_blocks = blocks_per_seq
        self.computed = [0] * num_seqs

    def step(self, seqs: list[int], chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Feed chunk i [q_i, H] to sequence seqs[i] (all in one flat batch); returns each chunk's hidden."""
        slots, positions, seq_lens, qlens = [], [], [], []
        for s, chunk in zip(seqs, chunks, strict=True):
            start, q = self.computed[s], chunk.shape[0]
            for p in range(start, start + q):
                slots.append(self.tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
                positions.append(p)
            seq_lens.append(start + q)
            qlens.append(q)
        tables = [self.tables[s] for s in seqs]
        decode = all(q == 1 for q in qlens)
        ids = None if decode else [0] * len(positions)  # the model sees embeddings; ids only mark a prefill
        self.attn.plan(StepBatch(list(seqs), positions, slots, qlens, seq_lens, tables, token_ids=ids))
        with torch.no_grad(), use_backend(self.attn):
            hidden = self.model(torch.cat(chunks), torch.tensor(positions))
        for s, q in zip(seqs, qlens, strict=True):
            self.computed[s] += q
        return list(hidden.split(qlens))


def text_logits(model: TalkerModel, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [B, H] -> text logits [B, vocab] fp32 (or only the columns ``token_ids``), as vLLM's head computes."""
    weight = model.text_head_weight if token_ids is None else model.text_head_weight.index_select(0, token_ids)
    return (hidden @ weight.t()).float()


def random_embeds(lengths: list[int], hidden: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) for n in lengths]


def test_flat_batch_prefill_matches_hf(pair, tol):
    lengths = [5, 11, 1, 8, 4]  # spanning 1..3 blocks of 4, one exactly one block
    seqs = random_embeds(lengths, pair.cfg.hidden_size, seed=1)
    runner = PagedRunner(pair, len(seqs), max(lengths))
    outs = runner.step(list(range(len(seqs))), seqs)
    for i, (emb, out) in enumerate(zip(seqs, outs, strict=True)):
        ref = hf_hidden(pair, emb)
        assert out.shape == ref.shape
        assert rel_err(out, ref) <= tol, (i, rel_err(out, ref))


def test_token_by_token_decode_matches_hf(pair, tol):
    """Prefill short prompts together, then decode one position per sequence per step through the cache."""
    prompt_lens, steps = [3, 6, 1], 12
    total = [p + steps for p in prompt_lens]
    seqs = random_embeds(total, pair.cfg.hidden_size, seed=2)
    refs = [hf_hidden(pair, s) for s in seqs]
    runner = PagedRunner(pair, len(seqs), max(total), seed=3)
    outs = runner.step([0, 1, 2], [s[:p] for s, p in zip(seqs, prompt_lens, strict=True)])
    for i, p in enumerate(prompt_lens):
        assert rel_err(outs[i], refs[i][:p]) <= tol
    for t in range(steps):
        order = [2, 0, 1] if t % 2 else [0, 1, 2]  # the batch order may change between steps
        chunks = [seqs[i][prompt_lens[i] + t][None] for i in order]
        outs = runner.step(order, chunks)
        for i, out in zip(order, outs, strict=True):
            pos = prompt_lens[i] + t
            err = rel_err(out[0], refs[i][pos])
            assert err <= tol, (t, i, err)


def test_single_sequence_decode_from_one_token(pair, tol):
    """The smallest case: a 1-token prefill, then decode-only steps with a batch of one."""
    seq = random_embeds([9], pair.cfg.hidden_size, seed=4)[0]
    ref = hf_hidden(pair, seq)
    runner = PagedRunner(pair, 1, 9, seed=5)
    got = [runner.step([0], [seq[:1]])[0][0]]
    for p in range(1, 9):
        got.append(runner.step([0], [seq[p : p + 1]])[0][0])
    assert rel_err(torch.stack(got), ref) <= tol


def test_chunked_prefill_mixed_with_decode_matches_hf(pair, tol):
    """Queries that are the tail of a longer context (q_len < seq_len), in a batch with a 1-token decode."""
    lens = [13, 7]
    seqs = random_embeds(lens, pair.cfg.hidden_size, seed=6)
    refs = [hf_hidden(pair, s) for s in seqs]
    runner = PagedRunner(pair, 2, max(lens), seed=7)
    runner.step([0, 1], [seqs[0][:5], seqs[1][:6]])
    out = runner.step([0, 1], [seqs[0][5:10], seqs[1][6:7]])  # a 5-token chunk next to a decode token
    assert rel_err(out[0], refs[0][5:10]) <= tol
    assert rel_err(out[1], refs[1][6:7]) <= tol
    out = runner.step([0], [seqs[0][10:13]])
    assert rel_err(out[0], refs[0][10:13]) <= tol


def test_text_logits_match_hf_lm_head(pair, tol):
    seq = random_embeds([6], pair.cfg.hidden_size, seed=8)[0]
    with torch.no_grad():
        hf_logits = pair.hf(inputs_embeds=seq[None], use_cache=False).logits[0]
    runner = PagedRunner(pair, 1, 6)
    hidden = runner.step([0], [seq])[0]
    logits = text_logits(pair.ours, hidden)
    assert logits.dtype == torch.float32 and logits.shape == hf_logits.shape
    assert rel_err(logits, hf_logits) <= tol + 2 * gamma(pair.case.hidden, torch.float32)  # + the head's product
    ids = torch.tensor([7, 0, 99])
    # the gathered columns are the same dot products as the full product's, rounded in another order
    head = pair.ours.text_head_weight
    assert_matmul_close(text_logits(pair.ours, hidden, ids), logits[:, ids], hidden, head[ids])


def test_bf16_model_stays_close_to_fp32_reference():
    """A bf16 copy of the model tracks the fp32 reference within bf16 precision (catches dtype mix-ups)."""
    pair = build_pair(CASES["gqa_wide_heads"], seed=9)
    bf16 = Pair(pair.hf, TalkerModel(pair.cfg).eval().requires_grad_(False), pair.cfg, pair.case)
    bf16.ours.load_state_dict(pair.ours.state_dict())
    bf16.ours.to(torch.bfloat16)
    seq = random_embeds([10], pair.cfg.hidden_size, seed=10)[0]
    t = pair.cfg.text
    caches = allocate_kv_caches(t, 4, BLOCK_SIZE, torch.bfloat16, "cpu")
    attn = SdpaAttention(caches, t.num_attention_heads, t.num_key_value_heads, t.head_dim, 16)
    attn.plan(StepBatch([0], list(range(10)), list(range(10)), [10], [10], [[0, 1, 2, 3]], token_ids=[0] * 10))
    with torch.no_grad(), use_backend(attn):
        out = bf16.ours(seq.bfloat16(), torch.arange(10))
    assert out.dtype == torch.bfloat16
    err = rel_err(out.float(), hf_hidden(pair, seq))
    # fp32 accumulation (CPU bf16 matmuls, SDPA and our norms accumulate in fp32), bf16 storage: the input, every
    # stored intermediate and the weights (4 matrices + 4 norm vectors per layer) are rounded once each
    reductions, roundings = qwen3_chain(pair.case, 10)
    tol = chain_rel_tol(reductions, 1 + roundings + 8 * pair.case.layers, torch.float32, torch.bfloat16)
    assert err <= tol, (err, tol)


def test_token_ids_embed_as_their_own_rows_and_rms_norm_keeps_its_epsilon(talker):
    """Every id, 0 included (``!`` in the tiny tokenizer), embeds as its own row of the table (a placeholder, < 0, as
    row 0 until it is replaced); RMSNorm adds its epsilon inside the root, which a row of tiny values shows (float64
    reference: without eps the row would normalise to unit scale)."""
    from higgs_talker.ops import TorchKernels

    table = talker.model.model.embed_tokens.weight
    ids = torch.tensor([0, 1, 7, talker.cfg.text.vocab_size - 1, -1])
    assert torch.equal(talker.model.embed_text(ids), table[[0, 1, 7, talker.cfg.text.vocab_size - 1, 0]])
    x = torch.full((1, 8), 1e-4, dtype=torch.float32)
    weight, eps = torch.ones(8), 1e-6
    want = (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)).float()
    assert torch.allclose(TorchKernels.rms_norm(x, weight, eps), want, rtol=1e-6, atol=0)
    assert not torch.allclose(want, torch.ones_like(want), rtol=1e-2)  # eps matters at this scale
