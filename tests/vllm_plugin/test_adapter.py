"""The adapter's runner contract (SPEC 6), driven directly like the vllm-omni runner drives it.

The vllm-omni runner does not run on CPU, so these tests build the adapter in-process with a real vLLM config
(a one-rank gloo group) and call the runner's methods in its order: ``update_decode_step_metadata`` ->
(forward) -> ``make_omni_output`` (handing on the rows of the step before, by request) -> ``compute_logits`` ->
``sample`` (/ ``post_sample_multimodal_outputs``) -> ``on_requests_finished``. Hidden rows are fed directly (no
attention), one deterministic vector per request and step, so a request's codes must not depend on its batch
neighbours or position.
"""

from __future__ import annotations

import logging
import random

import pytest

# skips the module cleanly where vLLM is not installed (the core test environment)
pytest.importorskip("vllm.config")

import socket  # noqa: E402
import zlib  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from higgs_talker.checkpoint import iter_tensors  # noqa: E402
from higgs_talker.config import TalkerConfig  # noqa: E402
from higgs_talker.heads.codebooks import feed_back  # noqa: E402
from higgs_talker.heads.delay import apply_delay_pattern  # noqa: E402
from higgs_talker.heads.spans import SpanStep  # noqa: E402

N_RAMP = 7  # rows of the delay pattern's ramp-up (SPEC 4.7)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return build_adapter(tiny_dir)


def build_adapter(tiny_dir, max_num_seqs: int = 8):
    """The talker adapter of the checkpoint ``tiny_dir`` in a real vLLM config on CPU (float32, eager), weights
    loaded and post-processed as vLLM's loader does (also ``benchmarks/probes/runner_host_time.py``'s)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.engine.arg_utils import EngineArgs

    from higgs_talker.vllm_plugin import register
    from higgs_talker.vllm_plugin.talker import HiggsTalkerForConditionalGeneration

    register()
    vc = EngineArgs(
        model=str(tiny_dir), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=max_num_seqs
    ).create_engine_config()
    with set_current_vllm_config(vc):
        if not model_parallel_is_initialized():
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, backend="gloo")
            initialize_model_parallel(1, 1)
        with torch.device("cpu"):
            model = HiggsTalkerForConditionalGeneration(vllm_config=vc)
    cfg = TalkerConfig.from_pretrained(tiny_dir)
    loaded = model.load_weights(iter_tensors(tiny_dir, cfg))
    assert loaded == {n for n, _ in model.named_parameters()}
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(vc):
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    return model


def _meta(n: int, temperature=None, generators=None):
    return SimpleNamespace(
        temperature=temperature,
        all_greedy=temperature is None,
        top_k=None,
        top_p=None,
        generators=generators or {},
        max_num_logprobs=None,
    )


def _hidden(key: str, step: int, h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{step}".encode()))
    return torch.randn(h, generator=g) * 3


class Driver:
    """Plays the vllm-omni runner: one token per request and step (the prompt is a single <|audio|>). ``rows``
    holds what the adapter handed on, by request: each step's ``make_omni_output`` brings the step before's."""

    def __init__(self, model) -> None:
        self.m = model
        self.pos: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self.rows: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}

    def step(self, req_ids: list[str], finished: set[str] | None = None) -> None:
        m, sp = self.m, self.m.specials
        stopped = {r for r in req_ids if self.tokens.get(r, [None])[-1] == sp.eos}  # vLLM stops them on EOS
        req_ids = [r for r in req_ids if r not in stopped]
        if finished or stopped:
            m.on_requests_finished((finished or set()) | stopped)
        ids, pos = [], []
        for r in req_ids:
            first = r not in self.pos
            self.pos.setdefault(r, 5)  # the prompt's last token (<|audio|>) sits at position 5
            self.steps.setdefault(r, 0)
            ids.append(sp.audio if first else self.tokens[r][-1])
            pos.append(self.pos[r])
        qsl = torch.arange(len(req_ids) + 1)
        m.update_decode_step_metadata(
            input_ids=torch.tensor(ids), positions=torch.tensor(pos), inputs_embeds=None,
            omni_query_start_loc=qsl, req_ids=list(req_ids),
        )  # fmt: skip
        # the forward's output, one token per request
        hidden = torch.stack([_hidden(r, self.steps[r], m.cfg.text.hidden_size) for r in req_ids])
        out = m.make_omni_output(hidden, model_intermediate_buffer=[{} for _ in req_ids])
        self._take(req_ids, (out.multimodal_outputs or {"codes": {"audio": [None] * len(req_ids)}})["codes"]["audio"])
        logits = m.compute_logits(hidden.clone())  # the runner's hidden[logits_indices]
        out = m.sample(logits, _meta(len(req_ids)))
        for i, r in enumerate(req_ids):
            self.tokens.setdefault(r, []).append(int(out.sampled_token_ids[i, 0]))
            self.pos[r] += 1
            self.steps[r] += 1

    def _take(self, req_ids: list[str], audio: list) -> None:
        for r, rows in zip(req_ids, audio, strict=True):
            if rows is not None and rows.numel():
                assert rows.dtype == torch.int32 and rows.shape[1:] == (8,)
                self.rows.setdefault(r, []).extend(rows.tolist())

    def finish(self, req_ids: set[str]) -> None:
        """The requests end: what they produced on the last step is taken first (as a runner asking after it)."""
        ids = sorted(req_ids)
        self._take(ids, self.m.post_sample_multimodal_outputs(req_ids=ids)["codes"]["audio"])
        self.m.on_requests_finished(req_ids)


def test_state_follows_request_ids_across_reorder_join_and_finish(adapter):
    a = Driver(adapter)
    for _ in range(12):
        a.step(["A", "B"])
    a.finish({"A", "B"})
    b = Driver(adapter)
    orders = [["B", "A"], ["C", "B", "A"], ["A", "C", "B"], ["B", "A", "C"], ["A", "B"], ["B", "A"]]
    for i in range(12):
        b.step(orders[i % len(orders)] if i < 6 else ["B", "A"], finished={"C"} if i == 6 else None)
    b.finish({"A", "B"})
    assert a.rows["A"] == b.rows["A"] and a.rows["B"] == b.rows["B"]
    assert len(a.rows["A"]) == 12
    # ramp-up: row t has codebooks > t equal to BOC
    cfg = adapter.cfg
    for t, row in enumerate(a.rows["A"][:8]):
        assert all(c == cfg.boc_id for c in row[t + 1 :])
    assert adapter.slots.requests == {}


def test_request_ids_from_prepare_runner_inputs_when_the_metadata_has_none(adapter):
    """vllm-omni 0.26 passes no req_ids to update_decode_step_metadata; its runner names them in
    prepare_runner_inputs just before. A dummy run (no prepare call) gets no step."""
    m, sp = adapter, adapter.specials
    ids, pos = torch.tensor([sp.audio, sp.audio]), torch.tensor([5, 5])
    assert m.prepare_runner_inputs(input_ids=ids, positions=pos, req_ids=["R1", "R2"]) == (ids, pos)
    m.update_decode_step_metadata(input_ids=ids, positions=pos, omni_query_start_loc=torch.arange(3))
    assert m.step is not None and m.step.req_ids == ["R1", "R2"]
    m.update_decode_step_metadata(input_ids=ids, positions=pos, omni_query_start_loc=torch.arange(3))
    assert m.step is None
    m.on_requests_finished({"R1", "R2"})


def test_reused_request_id_starts_fresh(adapter):
    d = Driver(adapter)
    for _ in range(3):
        d.step(["X"])
    d.finish({"X"})
    e = Driver(adapter)
    for _ in range(3):
        e.step(["X"])
    e.finish({"X"})
    assert d.rows["X"] == e.rows["X"] and len(d.rows["X"]) == 3


def test_pure_audio_steps_skip_the_text_head_and_force_tokens(adapter, monkeypatch):
    d = Driver(adapter)
    d.step(["P"])  # prefill-like step: the full head runs (the row is not yet in a stream)
    calls = []
    real = adapter.logits_processor.forward
    monkeypatch.setattr(adapter.logits_processor, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    for _ in range(3):
        d.step(["P"])
    assert calls == []
    assert d.tokens["P"] == [adapter.specials.audio] * 4
    adapter.on_requests_finished({"P"})


def test_done_row_forces_eos_and_closes_the_stream(adapter):
    d = Driver(adapter)
    d.step(["E"])
    slot = adapter.slots.requests["E"].slot
    adapter.slots.store.state.done[slot] = True  # as after the terminal ramp row
    adapter.slots.requests["E"].done = True
    d.step(["E"])
    assert d.tokens["E"][-1] == adapter.specials.eos
    assert len(d.rows["E"]) == 1 == len(adapter.slots.rows_for("E"))  # the first step's row, handed on now
    d.finish({"E"})
    assert len(d.rows["E"]) == 1  # no frame on the EOS step
    state = adapter.slots.store.state
    assert not bool(state.has_codes[slot]) and not bool(state.done[slot])
    adapter.on_requests_finished({"E"})


def test_seeded_requests_are_batch_independent(adapter):
    def run(order):
        d = Driver(adapter)
        for _ in range(6):
            ids = order
            m = adapter
            m.update_decode_step_metadata(
                input_ids=torch.tensor([m.specials.audio if r not in d.pos else d.tokens[r][-1] for r in ids]),
                positions=torch.tensor([d.pos.setdefault(r, 5) for r in ids]),
                omni_query_start_loc=torch.arange(len(ids) + 1), req_ids=ids,
            )  # fmt: skip
            hidden = torch.stack([_hidden(r, d.steps.setdefault(r, 0), m.cfg.text.hidden_size) for r in ids])
            logits = m.compute_logits(hidden)
            gens = {i: torch.Generator().manual_seed(100 + int(r[1:])) for i, r in enumerate(ids)}
            out = m.sample(logits, _meta(len(ids), temperature=torch.ones(len(ids)), generators=gens))
            d._take(ids, m.post_sample_multimodal_outputs(req_ids=ids)["codes"]["audio"])
            for i, r in enumerate(ids):
                d.tokens.setdefault(r, []).append(int(out.sampled_token_ids[i, 0]))
                d.pos[r] += 1
                d.steps[r] += 1
        m.on_requests_finished(set(ids))
        return d.rows

    alone = run(["S1"])
    together = run(["S2", "S1", "S3"])
    assert alone["S1"] == together["S1"]
    assert adapter.slots.store.seeds.numel() > 0


def test_publication_is_owned_and_each_row_goes_out_once(adapter):
    d = Driver(adapter)
    d.step(["O", "Q"])
    rows = adapter.post_sample_multimodal_outputs(req_ids=["O", "Q"], invalid_req_indices=[1])
    audio = rows["codes"]["audio"]
    assert audio[0].shape == (1, 8) and audio[1].shape == (0, 8)
    audio[0].fill_(-7)  # a consumer writing into its row must not change our records
    assert adapter.slots.requests["O"].rows[-1].min() >= 0
    d.step(["O", "Q"])  # hands on what is left of the step before: Q's row, not O's again
    assert len(d.rows["Q"]) == 1 and "O" not in d.rows
    assert adapter.make_omni_output(torch.zeros(1, 4)).multimodal_outputs is None  # a dummy run: no requests
    d.finish({"O", "Q"})
    assert len(d.rows["O"]) == 1 and len(d.rows["Q"]) == 2


def test_the_rows_of_a_step_go_to_their_requests_in_the_next_steps_order(adapter):
    """Each request's rows go out with its own place in the step that hands them on, whatever the order of that
    step or whoever it leaves out (a request not scheduled gets its rows when it is next), and sampling a step
    records nothing on the host until they are asked for (``sample`` takes no host sync)."""
    m, ids = adapter, ["K1", "K2", "K3"]
    m.update_decode_step_metadata(
        input_ids=torch.full((3,), m.specials.audio), positions=torch.full((3,), 5),
        omni_query_start_loc=torch.arange(4), req_ids=ids,
    )  # fmt: skip
    hidden = torch.stack([_hidden(r, 0, m.cfg.text.hidden_size) for r in ids])  # the forward's output
    m.make_omni_output(hidden, model_intermediate_buffer=[{}, {}, {}])
    m.sample(m.compute_logits(hidden.clone()), _meta(3))
    assert all(m.slots.requests[r].rows == [] for r in ids)  # on the way to the host
    d = Driver(m)
    d.pos, d.steps = dict.fromkeys(ids, 6), dict.fromkeys(ids, 1)
    d.tokens = {r: [m.specials.audio] for r in ids}
    d.step(["K3", "K1"])  # K2 is not scheduled this step
    recorded = {r: m.slots.rows_for(r)[:1].tolist() for r in ids}
    assert len({str(v) for v in recorded.values()}) == 3  # a swap would show
    assert d.rows == {"K3": recorded["K3"], "K1": recorded["K1"]}
    d.step(["K1", "K2", "K3"])
    assert d.rows["K2"] == recorded["K2"] and len(d.rows["K1"]) == len(d.rows["K3"]) == 2
    d.finish(set(ids))


def test_a_step_left_to_vllms_sampler_is_not_used_by_a_later_forward(adapter, monkeypatch):
    """compute_logits falls back to plain logits (here: more rows than the step has requests), so sample() leaves
    the step to vLLM's sampler. A later forward without fresh step metadata (a dummy run) must not lay that old
    step's code rows over its tokens, and no row goes out for it."""
    m = adapter
    monkeypatch.setattr(m.local_mlp, "forward", lambda positions, embeds, pure_decode: embeds)  # no attention here
    calls = []
    real = SpanStep.prompt_rows
    monkeypatch.setattr(SpanStep, "prompt_rows", lambda step, *a: calls.append(step) or real(step, *a))
    Driver(m).step(["D0"])  # a sampled step before: its rows must not be published again
    ids, pos = torch.tensor([1, 2, m.specials.audio]), torch.arange(3)
    m.update_decode_step_metadata(
        input_ids=ids, positions=pos, omni_query_start_loc=torch.tensor([0, 3]), req_ids=["D"]
    )  # fmt: skip
    hidden = m.forward(ids, pos)
    assert len(calls) == 1  # a prefill step: its prompt rows are laid
    assert m.make_omni_output(hidden).multimodal_outputs is None  # D0's row waits for D0; D has none
    assert m.sample(m.compute_logits(hidden[:2]), _meta(2)) is None
    assert m.post_sample_multimodal_outputs(req_ids=["D"])["codes"]["audio"][0].numel() == 0
    m.forward(ids, pos)  # a dummy run: no update_decode_step_metadata before it
    assert len(calls) == 1 and m.step is None
    m.on_requests_finished({"D0", "D"})


def test_feedback_replaces_only_decode_tokens_of_streams(adapter):
    d = Driver(adapter)
    d.step(["F"])  # F now has a frame to feed back
    m = adapter
    # mixed step: G prefills 3 tokens, F decodes one
    ids = torch.tensor([1, 2, m.specials.audio, m.specials.audio])
    m.update_decode_step_metadata(
        input_ids=ids, positions=torch.tensor([0, 1, 2, 6]), omni_query_start_loc=torch.tensor([0, 3, 4]),
        req_ids=["G", "F"],
    )  # fmt: skip
    embeds = m.embed_input_ids(ids)
    fed = feed_back(embeds, m.buffers.use[:4], m.buffers.codes[:4], m.multimodal_embedding)
    slot = m.slots.requests["F"].slot
    want = m.multimodal_embedding(m.slots.store.state.last_codes[slot][None])[0]
    assert torch.equal(fed[:3], embeds[:3])
    assert torch.allclose(fed[3], want)
    m.on_requests_finished({"F", "G"})
    m.step = None


def test_voice_clone_reference_rows_replace_placeholders_by_position(adapter):
    m = adapter
    cfg = m.cfg
    ref = apply_delay_pattern(torch.randint(0, 1024, (2, 8)), cfg.boc_id, cfg.eoc_id)  # [9, 8]
    prompt_len = 14
    where = torch.arange(2, 11)
    ids = torch.full((prompt_len,), m.specials.tts)
    info = {"audio_input_ids": ref, "audio_input_ids_mask": torch.ones(9, dtype=torch.bool),
            "audio_placeholder_positions": where}  # fmt: skip
    # chunked prefill: the first chunk covers positions 0..5, the second 6..13
    for lo, hi in ((0, 6), (6, prompt_len)):
        qsl, pos = torch.tensor([0, hi - lo]), torch.arange(lo, hi)
        batch = SpanStep(["V"], slots=torch.tensor([0]), qsl=qsl, input_ids=ids[lo:hi], positions=pos)
        embeds = m.embed_input_ids(ids[lo:hi])
        out, _ = batch.prompt_rows(m.slots, [info], embeds, m.multimodal_embedding)
        for j, p in enumerate(range(lo, hi)):
            if 2 <= p <= 10:
                assert torch.allclose(out[j], m.multimodal_embedding(ref[p - 2][None])[0])
            else:
                assert torch.equal(out[j], embeds[j])


class _Elsewhere(torch.Tensor):
    """A CPU tensor playing one on another device (a runner that keeps ``audio_input_ids`` on the GPU): what is
    computed from it stays there, ``.to(device)`` brings it over, and ``torch.cat`` refuses to mix it with local
    tensors, as torch does across devices."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat and len({isinstance(t, cls) for t in (args[0] if args else kwargs["tensors"])}) > 1:
            raise RuntimeError("Expected all tensors to be on the same device")
        out = super().__torch_function__(func, types, args, kwargs)
        if func is torch.Tensor.to and ("device" in kwargs or any(isinstance(a, torch.device) for a in args[1:])):
            with torch._C.DisableTorchFunctionSubclass():
                return out.as_subclass(torch.Tensor)
        return out


def test_reference_and_recorded_rows_from_different_devices_embed_together(adapter):
    """A preempted voice-clone request recomputed from position 0 in one prefill: its reference rows (on another
    device here) and the rows it was fed (recorded on the CPU) both land at their positions."""
    m = adapter
    d = Driver(m)
    for _ in range(3):
        d.step(["W"])  # the prompt's <|audio|> at 5 opened the stream: rows 0-2 are fed at positions 6-8
    req = m.slots.requests["W"]
    ref = torch.randint(0, 1024, (2, 8), generator=torch.Generator().manual_seed(4))
    info = {"audio_input_ids": ref.as_subclass(_Elsewhere), "audio_placeholder_positions": torch.tensor([1, 2])}
    ids = torch.full((9,), m.specials.tts)
    step = SpanStep(["W"], slots=torch.tensor([req.slot]), qsl=torch.tensor([0, 9]), input_ids=ids,
                    positions=torch.arange(9))  # fmt: skip
    embeds = m.embed_input_ids(ids)
    out, refed = step.prompt_rows(m.slots, [info], embeds, m.multimodal_embedding)
    assert refed == 3 and type(out) is torch.Tensor
    for p, row in ((1, ref[0]), (2, ref[1]), (6, req.rows[0]), (7, req.rows[1]), (8, req.rows[2])):
        assert torch.allclose(out[p], m.multimodal_embedding(row.long()[None])[0])
    assert torch.equal(out[[0, 3, 4, 5]], embeds[[0, 3, 4, 5]])
    m.on_requests_finished({"W"})


def test_load_weights_rejects_unexpected_and_missing_keys(adapter, tiny_dir):
    from vllm.config import set_current_vllm_config

    from higgs_talker.vllm_plugin.talker import HiggsTalkerForConditionalGeneration

    cfg = adapter.cfg
    weights = list(iter_tensors(tiny_dir, cfg))
    with set_current_vllm_config(adapter.vllm_config), torch.device("cpu"):
        fresh = HiggsTalkerForConditionalGeneration(vllm_config=adapter.vllm_config, prefix="fresh")
    with pytest.raises(ValueError, match="unexpected checkpoint key"):
        fresh.load_weights([("body.extra.weight", torch.zeros(1)), *weights])
    with pytest.raises(ValueError, match="missing 1 required key.*body.norm.weight"):
        fresh.load_weights([w for w in weights if w[0] != "body.norm.weight"])
    assert fresh.load_weights(weights) == {n for n, _ in fresh.named_parameters()}


def test_load_weights_asks_for_row_linears_where_the_config_does(adapter, tiny_dir, monkeypatch, caplog):
    """``hf_overrides: {higgs_row_linears: true}`` reaches ``use_measured_rows_linear`` at load, with the stage's
    layers: on CPU it logs why the linears stay as they are."""
    from vllm.config import set_current_vllm_config

    from higgs_talker.row_linear_op import ASK_KEY
    from higgs_talker.vllm_plugin.talker import HiggsTalkerForConditionalGeneration

    with set_current_vllm_config(adapter.vllm_config), torch.device("cpu"):
        fresh = HiggsTalkerForConditionalGeneration(vllm_config=adapter.vllm_config, prefix="rows")
    monkeypatch.setattr(adapter.vllm_config.model_config.hf_config, ASK_KEY, True, raising=False)
    with caplog.at_level(logging.INFO):
        fresh.load_weights(iter_tensors(tiny_dir, adapter.cfg))
    said = [r.getMessage() for r in caplog.records if ASK_KEY in r.getMessage()]
    assert said == [f"higgs talker (vLLM adapter): {ASK_KEY}: our row linears need a CUDA device; the linears stay "
                    "as they are"], said  # fmt: skip


def test_unseeded_requests_draw_the_same_seeds_on_every_rank(adapter):
    """Tensor parallelism runs one adapter per rank; an unseeded request must get the same sampling seed on each
    (else the ranks feed different rows back): the seeds come from vLLM's model seed, in order of first sight."""
    from higgs_talker.heads.slots import RequestSlots, SlotStore

    store = adapter.slots.store

    def rank(seed):
        twin = SlotStore(store.capacity, store.num_codebooks, store.codebook_size, adapter.cfg.boc_id,
                         adapter.cfg.eoc_id, store.device)  # fmt: skip
        return RequestSlots(twin, seed=seed)

    model_seed = adapter.vllm_config.model_config.seed
    a, b = rank(model_seed), rank(model_seed)
    for slots in (a, b):
        slots.sync(["u1", "u2"])
        slots.sync(["u2", "u3"])
    assert [a.requests[r].seed for r in ("u1", "u2", "u3")] == [b.requests[r].seed for r in ("u1", "u2", "u3")]
    assert len({a.requests[r].seed for r in ("u1", "u2", "u3")}) == 3
    other = rank(model_seed + 1)
    other.sync(["u1"])
    assert other.requests["u1"].seed != a.requests["u1"].seed
    # the adapter draws from a seeded generator (its model seed), not from the OS
    assert type(adapter.slots._seeds) is random.Random


@pytest.mark.parametrize("top_k", ["none", "codebook_size"])
def test_top_p_one_keeps_every_code_of_a_long_tail(adapter, monkeypatch, top_k):
    """vLLM's per-row params with top_p = 1.0 and top-k off (None, or the codebook size) are no filter: on
    long-tailed code logits, every code the delay mask leaves stays in the race (none is dropped by the nucleus),
    and the scores equal those of the unfiltered sampler."""
    from _long_tail import long_tailed_logits

    import higgs_talker.heads.slots as slots_module
    from higgs_talker.heads.sampling import race_scores

    m, cfg = adapter, adapter.cfg
    ids = ["L1", "L2", "L3", "L4"]
    b, n, v = len(ids), cfg.num_codebooks, cfg.codebook_size
    tail = long_tailed_logits(b * n, seed=6, v=v).view(b, n, v)
    monkeypatch.setattr(m.modality_head, "forward", lambda hidden: tail[: hidden.shape[0]].clone())
    seen = []
    real = slots_module.sample_codes

    def spy(logits, temperature, top_k, top_p, seeds, steps, **shortcuts):
        seen.append((logits.clone(), temperature, top_k, top_p, seeds, steps))
        return real(logits, temperature, top_k, top_p, seeds, steps, **shortcuts)

    monkeypatch.setattr(slots_module, "sample_codes", spy)
    meta = SimpleNamespace(
        temperature=torch.ones(b), all_greedy=False, top_k=None if top_k == "none" else torch.full((b,), v),
        top_p=torch.ones(b), generators={}, max_num_logprobs=None,
    )  # fmt: skip
    tokens = [m.specials.audio] * b
    for step in range(N_RAMP + 1):  # the last step samples all 8 codebooks (the delay ramp is over)
        m.update_decode_step_metadata(
            input_ids=torch.tensor(tokens), positions=torch.full((b,), 5 + step), inputs_embeds=None,
            omni_query_start_loc=torch.arange(b + 1), req_ids=ids,
        )  # fmt: skip
        hidden = torch.stack([_hidden(r, step, cfg.text.hidden_size) for r in ids])
        tokens = m.sample(m.compute_logits(hidden), meta).sampled_token_ids[:, 0].tolist()
    m.on_requests_finished(set(ids))
    assert len(seen) == N_RAMP + 1
    logits, temperature, k, p, seeds, steps = seen[-1]
    assert torch.equal(p, torch.ones(b))
    scores = race_scores(logits, temperature, k, p, seeds, steps)
    lost = logits.isfinite() & ~scores.isfinite()
    assert not lost.any(), f"{int(lost.sum())} codes of the tail were dropped"
    assert logits.isfinite().sum() > 0.99 * logits.numel()  # after the ramp the delay mask leaves all but BOC
    assert torch.equal(scores, race_scores(logits, temperature, k, p, seeds, steps, filter=False))


class _Calls(TorchDispatchMode):
    """Counts the aten calls made while ``where`` names an entry point (a GPU launches a kernel for most)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: str | None = None
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.where is not None:
            self.calls[self.where] = self.calls.get(self.where, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("batch", [1, 8])
def test_a_decode_step_of_streams_calls_little_outside_the_frame_work(adapter, monkeypatch, batch):
    """Host work a decode step of requests in their streams (every text token forced) does outside the frame work
    (``frame_results``, which the frame graphs replay in one launch): the rows are classified and the sampling
    parameters normalized inside the frame work, ``compute_logits`` builds only the forced tokens' logits (no text
    head, no classification) and a one-token-per-request step needs no span arithmetic, and the rows go out in one
    copy, not one per request. 26 aten calls a step at one stream, 27 at eight (77 and 89 before these moved,
    8b57d9e; 37 at eight before the one copy); on the H200 each call cost about 20 us of a 5.4 ms step inside
    vllm-omni. Fails when the classification comes back to ``compute_logits`` (20 more)."""
    m, counter = adapter, _Calls()
    real_frame = m.frame

    def frame(*args, **kwargs):  # not counted: a graph replay on the GPU
        where, counter.where = counter.where, None
        try:
            return real_frame(*args, **kwargs)
        finally:
            counter.where = where

    monkeypatch.setattr(m, "frame", frame)
    for name in ("update_decode_step_metadata", "make_omni_output", "compute_logits", "sample"):
        real = getattr(m, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counter.where = _name
            try:
                return _real(*args, **kwargs)
            finally:
                counter.where = None

        monkeypatch.setattr(m, name, counted)
    d, ids = Driver(m), [f"ops{batch}_{i}" for i in range(batch)]
    for _ in range(N_RAMP + 2):  # into the streams: every request known to be in audio mode
        d.step(ids)
    with counter:
        for _ in range(10):
            d.step(ids)
    d.finish(set(ids))
    per_step = {k: v / 10 for k, v in counter.calls.items()}
    print(f"aten calls a decode step outside the frame work, {batch} streams: {per_step}")
    assert per_step["compute_logits"] <= 8 and per_step.get("sample", 0) <= 3, per_step
    # handing the rows on costs the same at any batch: one copy of every new row, split by request (8 -> 64
    # streams took make_omni_output from 18.8 to 123 calls a step when each request's rows were stacked alone)
    assert per_step["make_omni_output"] <= 10, per_step
    assert sum(per_step.values()) <= 29, per_step


def test_row_linears_find_vllms_unquantized_linears_and_stay_off_without_cuda(adapter, monkeypatch):
    """``row_linear_op.use_rows_linear`` picks linears by their method's class name: vLLM's layers of this model
    have that class, and the switched method is still one (vLLM's isinstance checks); asked on a CPU model, or with
    vLLM's batch-invariant mode on, ``use_measured_rows_linear`` says why it did nothing and switches nothing."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from higgs_talker.cuda_graphs.kernels import ROW_LINEARS
    from higgs_talker.row_linear_op import ASK_KEY, use_measured_rows_linear, use_rows_linear

    layers = list(adapter.model.layers)
    modules = [of(layer) for layer in layers for of in ROW_LINEARS.values()]
    assert all(type(m.quant_method) is UnquantizedLinearMethod for m in modules)
    said = use_measured_rows_linear(layers, SimpleNamespace(**{ASK_KEY: True}))
    assert said == f"{ASK_KEY}: our row linears need a CUDA device; the linears stay as they are"
    assert use_measured_rows_linear(layers, SimpleNamespace()) is None
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    said = use_measured_rows_linear(layers, SimpleNamespace(**{ASK_KEY: True}))
    assert said == f"{ASK_KEY}: VLLM_BATCH_INVARIANT is set; the linears stay as they are"
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert all(type(m.quant_method) is UnquantizedLinearMethod for m in modules)
    methods = [m.quant_method for m in modules]
    try:
        assert use_rows_linear(layers) == len(modules)
        assert all(isinstance(m, UnquantizedLinearMethod) and type(m) is not UnquantizedLinearMethod for m in methods)
    finally:
        for m in methods:
            m.__class__ = UnquantizedLinearMethod


def test_runner_host_time_probe_times_each_entry_point_and_puts_them_back(adapter, monkeypatch):
    """``benchmarks/probes/runner_host_time.py`` on this fixture: a time for every entry point and the frame work,
    ``sample`` less the frame work, and the adapter's own callables back in place afterwards."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))
    import runner_host_time as probe

    before = {name: getattr(adapter, name) for name in (*probe.ENTRY_POINTS, "frame")}
    t = probe.host_time(adapter, Driver, N_RAMP, batch=2, steps=3)
    assert set(t) == {*probe.ENTRY_POINTS, "frame"} and all(v > 0 for v in t.values()), t
    assert t["frame"] > t["sample"], t  # on CPU the frame work (head, sampler) outweighs what sample adds to it
    assert {name: getattr(adapter, name) for name in before} == before
    assert not set(probe.ENTRY_POINTS) & set(vars(adapter))  # no wrapper or copy left on the instance
