"""The text-only bridge's request bookkeeping over vLLM's batch updates (no model run)."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

pytest.importorskip("vllm.v1.sample.logits_processor")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

import higgs_talker.vllm_plugin.bridge as bridge_module  # noqa: E402
from higgs_talker.vllm_plugin.bridge import REQUEST_KEY, TextOnlyBridge  # noqa: E402


class FakeTalker:
    """Records what the bridge tells the model: removals, and the batch it arms each step."""

    def __init__(self) -> None:
        self.removed: list[str] = []
        self.batches: list[list[str]] = []
        self.resumed: list[set[str]] = []
        self.slots = type("Slots", (), {"keep_finished": 0})()

    def on_requests_removed(self, keys) -> None:
        self.removed.extend(keys)

    def set_bridge_requests(self, keys, seeds, min_rows, refs, resume) -> None:
        self.batches.append(list(keys))
        self.resumed.append(set(resume or ()))


def added(index: int, key: str):
    return (index, SamplingParams(max_tokens=4, extra_args={REQUEST_KEY: key}), [1, 2], [])


@pytest.fixture
def bridge(monkeypatch):
    talker = FakeTalker()
    monkeypatch.setattr(bridge_module, "talker_for", lambda _cfg: talker)
    return TextOnlyBridge(object(), None, False), talker


def test_a_removal_reported_only_through_a_condensing_move_is_released(bridge):
    """vLLM 0.26 fills a removed row's index by moving the last row down and reports that removal only as
    the move (the index leaves ``removed``): the removed request's slot must still be released."""
    b, talker = bridge
    b.update_state(BatchUpdate(4, [], [added(i, k) for i, k in enumerate("abcd")], []))
    assert talker.batches[-1] == ["a", "b", "c", "d"]
    b.update_state(BatchUpdate(3, [], [], [(3, 1, MoveDirectionality.UNIDIRECTIONAL)]))  # b left; d moved to 1
    assert talker.removed == ["b"] and talker.batches[-1] == ["a", "d", "c"]
    b.update_state(BatchUpdate(3, [], [], [(0, 2, MoveDirectionality.SWAP)]))  # a swap releases nothing
    assert talker.removed == ["b"] and talker.batches[-1] == ["c", "d", "a"]


def test_removed_and_replaced_rows_are_released_once(bridge):
    b, talker = bridge
    b.update_state(BatchUpdate(3, [], [added(i, k) for i, k in enumerate("abc")], []))
    b.update_state(BatchUpdate(2, [2], [added(0, "e")], []))  # a replaced by e at 0, c removed from the tail
    assert sorted(talker.removed) == ["a", "c"] and talker.batches[-1] == ["e", "b"]
    # the same removal reported both ways (an index in removed and moved into) counts once
    b.update_state(BatchUpdate(1, [0], [], [(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert sorted(talker.removed) == ["a", "c", "e"] and talker.batches[-1] == ["b"]


def test_the_rows_extension_name_resolves_to_the_worker_extension():
    """vLLM imports ``worker_extension_cls`` by its qualified name in each worker process."""
    import importlib

    from higgs_talker.vllm_plugin import ROWS_EXTENSION
    from higgs_talker.vllm_plugin.bridge import RowsWorkerExtension

    module, name = ROWS_EXTENSION.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is RowsWorkerExtension
    assert callable(RowsWorkerExtension.higgs_request_rows) and callable(RowsWorkerExtension.higgs_adapter_report)


@pytest.mark.parametrize("extension", [bridge_module.ROWS_EXTENSION, None])
def test_request_rows_asks_workers_by_name_or_by_function(extension):
    """With the rows extension a worker is asked by method name; without it the same method goes as a function
    called with the worker (vLLM's collective_rpc either way)."""
    from types import SimpleNamespace as NS

    slots = NS(rows_by_key=lambda keys: {k: [[5] * 8] if k == "a" else None for k in keys})
    worker = bridge_module.RowsWorkerExtension()
    worker.model_runner = NS(get_model=lambda: NS(slots=slots))
    sent = []

    def collective_rpc(method, args):
        sent.append(method)
        call = getattr(worker, method) if isinstance(method, str) else functools.partial(method, worker)  # as vLLM
        return [call(*args)]  # one worker

    llm = NS(
        llm_engine=NS(vllm_config=NS(parallel_config=NS(worker_extension_cls=extension))), collective_rpc=collective_rpc
    )
    got = bridge_module.request_rows(llm, ["a", "b"])
    assert got["a"].tolist() == [[5] * 8] and got["b"] is None
    assert isinstance(sent[0], str) == (extension is not None)


# ----------------------------------------------------------------------- rows from data-parallel engines


class FakeClient:
    """An AsyncLLM engine client with data-parallel engines: each engine answers ``collective_rpc`` with its
    workers' answers (one per tensor-parallel rank)."""

    def __init__(self, engines: dict[str, list[dict]]) -> None:
        self.core_engines = list(engines)
        self.engines = engines
        self.calls: list[tuple] = []

    async def _call_utility_async(self, method, *args, engine):
        self.calls.append((method, args, engine))
        return self.engines[engine]


class FakeAsyncLLM:
    def __init__(self, engines: dict[str, list[dict]], extension: str = bridge_module.ROWS_EXTENSION) -> None:
        self.engine_core = FakeClient(engines)
        parallel = type("Parallel", (), {"worker_extension_cls": extension})()
        self.vllm_config = type("Config", (), {"parallel_config": parallel})()

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return await self.engine_core._call_utility_async("collective_rpc", method, timeout, args, kwargs,
                                                          engine=self.engine_core.core_engines[0])  # fmt: skip


def rows_of(engines, fake=None):
    return asyncio.run(bridge_module.request_rows_async(fake or FakeAsyncLLM(engines), ["a", "b", "c"]))


def test_rows_come_from_the_engine_that_served_each_request():
    engines = {"e0": [{"a": [[1] * 8], "b": None, "c": None}] * 2,  # two TP ranks, the same rows
               "e1": [{"a": None, "b": [[2] * 8, [3] * 8], "c": None}]}  # fmt: skip
    got = rows_of(engines)
    assert got["a"].tolist() == [[1] * 8] and got["b"].tolist() == [[2] * 8, [3] * 8] and got["c"] is None
    assert got["b"].dtype == torch.int32


def test_every_engine_is_asked():
    engines = {"e0": [{"a": None, "b": None, "c": None}], "e1": [{"a": None, "b": None, "c": None}]}
    fake = FakeAsyncLLM(engines)
    rows_of(engines, fake)
    assert sorted(call[2] for call in fake.engine_core.calls) == ["e0", "e1"]
    assert {call[1][0] for call in fake.engine_core.calls} == {"higgs_request_rows"}


def test_rows_need_the_rows_extension():
    fake = FakeAsyncLLM({"e0": [{"a": None, "b": None, "c": None}]}, extension="")
    with pytest.raises(ValueError, match="worker_extension_cls="):
        rows_of({}, fake)
    assert not fake.engine_core.calls  # refused before asking anyone


@pytest.mark.parametrize("temperature", [1e-6, 0.0])
def test_bridge_codes_follow_the_core_greedy_rule(monkeypatch, temperature):
    """The bridge passes each request's own temperature to the core, whose one rule is "greedy at <= 0": at 1e-6
    the codes equal the direct engine's (which samples, and breaks ties by noise, not by the lowest index; the
    bridge used to call anything below 1e-5 greedy), at 0 both take the argmax."""
    from higgs_talker.heads.slots import SlotInit, SlotStore, sample_frame

    b, n, v, boc, eoc = 16, 8, 12, 10, 11
    seeds = [1000 + i for i in range(b)]
    talker = FakeTalker()
    talker.sample_codes = lambda *params: talker.__dict__.setdefault("params", params)
    monkeypatch.setattr(bridge_module, "talker_for", lambda _cfg: talker)
    bridge = TextOnlyBridge(object(), None, False)
    rows = []
    for i, s in enumerate(seeds):
        params = SamplingParams(seed=s, extra_args={REQUEST_KEY: f"r{i}"})
        params.temperature = temperature  # past vLLM's own floor (it raises 0 < T < 0.01 to 0.01 on construction)
        rows.append((i, params, [1], []))
    bridge.update_state(BatchUpdate(b, [], rows, []))
    bridge.apply(torch.zeros(b, 4))
    logits = torch.zeros(b, n, v)  # every code of codebook 0 ties: only noise can pick another than code 0

    def codes(params, inits):
        store = SlotStore(b, n, v, boc, eoc, torch.device("cpu"))
        store.reset(inits)
        return sample_frame(store, torch.arange(b), logits.clone(), params=params)[0]

    engine = codes(None, [SlotInit(i, s, temperature=temperature) for i, s in enumerate(seeds)])
    plugin = codes(talker.params, [SlotInit(i, s) for i, s in enumerate(seeds)])
    assert torch.equal(plugin, engine)
    assert bool((engine[:, 0] != 0).any()) == (temperature > 0)


# ----------------------------------------------------------------------- what a request may ask of the bridge


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 2, "temperature": 1.0}, "n=2"),
        ({"allowed_token_ids": [5]}, "allowed_token_ids"),
        ({"structured_outputs": "regex"}, "structured outputs"),
    ],
)
def test_what_the_bridge_cannot_honour_is_refused_when_the_request_is_added(kwargs, match):
    """vLLM runs a logits processor's ``validate_params`` on each request as it is added (a 400 under ``vllm
    serve``, that request only). n > 1 copies shared one key and so one decode-state slot (their rows interleaved
    under it); structured outputs and allowed_token_ids masked the forced <|audio|>/EOS token (garbage text
    tokens, no stop at the stream's end; a grammar ended the request with finish_reason 'error')."""
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    from higgs_talker.vllm_plugin import TEXT_ONLY_BRIDGE

    try:  # what vLLM turns the processor's ValueError into (0.30; no subclass of ValueError)
        from vllm.exceptions import VLLMValidationError as refused
    except ImportError:
        refused = ValueError

    if kwargs.get("structured_outputs") == "regex":
        from vllm.sampling_params import StructuredOutputsParams

        kwargs = {"structured_outputs": StructuredOutputsParams(regex="a+")}
    params = SamplingParams(max_tokens=4, extra_args={REQUEST_KEY: "k"}, **kwargs)
    with pytest.raises(refused, match=match):
        validate_logits_processors_parameters([TEXT_ONLY_BRIDGE], params)
    honoured = dict(temperature=1.0, seed=1, logprobs=2, prompt_logprobs=1, min_tokens=2, repetition_penalty=1.5)
    plain = SamplingParams(max_tokens=4, extra_args={REQUEST_KEY: "k"}, **honoured)
    validate_logits_processors_parameters([TEXT_ONLY_BRIDGE], plain)  # what it honours passes


def test_a_key_already_live_in_the_batch_gets_a_unique_one(bridge, caplog):
    """Two live requests on one key shared one decode-state slot: both streams advanced it, their rows
    interleaved under the key (seeds 3 and 4 served together: 44 rows, both cut at 23 tokens; alone 22 and 100).
    A request added with a live key now gets a unique one, named in a warning; a key reused after its request
    left is kept."""
    b, talker = bridge
    b.update_state(BatchUpdate(2, [], [added(0, "a"), added(1, "a")], []))
    first, second = talker.batches[-1]
    assert first == "a" and second.startswith("a#")
    assert second in caplog.text
    b.update_state(BatchUpdate(3, [], [added(2, "a")], []))  # joins later, "a" still live
    third = talker.batches[-1][2]
    assert third.startswith("a#") and len(set(talker.batches[-1])) == 3
    b.update_state(BatchUpdate(1, [1, 2], [added(0, "a")], []))  # the first left; a new "a" takes its place
    assert sorted(talker.removed) == sorted([second, third, "a"]) and talker.batches[-1] == ["a"]


def test_a_request_back_from_preemption_resumes_under_its_own_key_even_when_renamed(bridge):
    """A request added with generated tokens (a preempted one come back) resumes its slot; when its key is live in
    the batch, it gets a unique one, and the resume goes with it, not to the live request that holds the key."""
    b, talker = bridge
    b.update_state(BatchUpdate(1, [], [added(0, "a")], []))
    assert talker.resumed[-1] == set()
    back = (1, SamplingParams(max_tokens=4, extra_args={REQUEST_KEY: "a"}), [1, 2], [7, 8])  # two tokens generated
    b.update_state(BatchUpdate(2, [], [back], []))
    first, second = talker.batches[-1]
    assert first == "a" and second.startswith("a#")
    assert talker.resumed[-1] == {second}
    b.update_state(BatchUpdate(2, [], [], []))  # nothing added: nothing resumes
    assert talker.resumed[-1] == set()
