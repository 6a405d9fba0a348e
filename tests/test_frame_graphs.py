"""The vLLM adapter's frame graphs (``cuda_graphs.frame``): a step's frame work replayed per batch bucket.

On CPU the bucket logic runs with the graph's replay played by the eager frame over the bucket's static tensors
(what a captured graph does): a batch smaller than its bucket gets the eager results of its own rows, and the
padding rows touch no request's slot. On CUDA (marked gpu) the real capture: its check fails a frame that is not
the one captured, and replays give the eager results over several steps of a live batch whose size changes.
"""

from __future__ import annotations

import functools

import pytest
import torch

from higgs_talker.cuda_graphs.frame import FrameGraphs, _Bucket
from higgs_talker.heads.slots import RequestSlots, SlotStore
from higgs_talker.heads.spans import frame_results

C, V, BOC, EOC, H = 8, 1026, 1024, 1025, 32
AUDIO, EOS = 50, 51  # the text tokens <|audio|> and EOS
frame = functools.partial(frame_results, audio_id=AUDIO, eos_id=EOS)


def _slots(device) -> RequestSlots:
    return RequestSlots(SlotStore(16, C, V, BOC, EOC, device), seed=3)


def _head(device):
    w = torch.randn(C * V, H, generator=torch.Generator().manual_seed(1)).to(device)
    return lambda h: torch.nn.functional.linear(h.float(), w).view(h.shape[0], C, V)


def _batch(slots: RequestSlots, ids: list[str], step: int, device) -> tuple:
    """A decode step of ``ids``, each tail the forced ``<|audio|>``: a request new to the slots opens its stream, the
    others are due their next frame (their tail at ``seed_pos`` + rows produced). Sampling at temperature 1 with
    top-k 50 and top-p 0.95, every third step greedy with no parameters at all (vLLM's metadata: None)."""
    s, _ = slots.sync(ids)
    b = len(ids)
    g = torch.Generator().manual_seed(100 + step)
    hidden = (torch.randn(b, H, generator=g) * 3).to(device)
    tail_ids = torch.full((b,), AUDIO, device=device)
    streaming = slots.store.state.has_codes.index_select(0, s)
    due = slots.seed_pos.index_select(0, s) + slots.store.num_rows.index_select(0, s)
    tail_pos = torch.where(streaming, due, 5 + step)
    params = (torch.ones(b, device=device), torch.full((b,), 50, device=device), torch.full((b,), 0.95, device=device))
    return s, hidden, tail_ids, tail_pos, (None, None, None) if step % 3 == 2 else params


def _state(slots: RequestSlots) -> list[torch.Tensor]:
    st = slots.store
    return [t.clone() for t in (*vars(st.state).values(), st.num_rows, slots.seed_pos)]


class _Replay:
    """Plays a captured graph on CPU: runs the frame over the bucket's static tensors into its static output."""

    def __init__(self, graphs: FrameGraphs, bucket: _Bucket) -> None:
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        g, b = self.graphs, self.bucket
        b.results.copy_(g.frame(g.slots, g.head, *b.args()))


def _emulated(slots: RequestSlots, head, replay=_Replay) -> tuple[FrameGraphs, _Bucket]:
    """Frame graphs over ``slots`` with one bucket of 4 rows, its capture played on CPU by ``replay``."""
    graphs = FrameGraphs(frame, slots, head, [4], max_batch=4, open_token=AUDIO)
    bucket = _Bucket(4, H, torch.float32, torch.device("cpu"), slots.store.scratch)
    bucket.results = torch.zeros(4, C + 3, dtype=torch.int32)
    bucket.graph = replay(graphs, bucket)
    graphs.buckets[4] = bucket
    return graphs, bucket


def test_a_bucket_gives_a_smaller_batch_its_own_rows_and_pads_with_the_scratch_slot():
    dev = torch.device("cpu")
    head = _head(dev)
    graphed, eager = _slots(dev), _slots(dev)
    graphs, bucket = _emulated(graphed, head)
    for step, ids in enumerate((["a", "b", "c"], ["a", "b", "c"], ["a", "c"], ["a", "b", "c", "d"], ["d"])):
        got = graphs.run(*_batch(graphed, ids, step, dev))
        want = frame(eager, head, *_batch(eager, ids, step, dev))
        assert got.shape == want.shape and torch.equal(got, want), (step, ids)
        assert got[:, C].all(), (step, ids)  # every row opened its stream or was due: a frame each
        live = [graphed.requests[r].slot for r in ids]
        for a, b in zip(_state(graphed), _state(eager), strict=True):  # every live slot as eager left it
            assert torch.equal(a[live], b[live])
    assert graphs.replays == 5 and graphs.run(*_batch(graphed, list("abcdef"), 9, dev)) is None  # no bucket: eager
    assert bucket.slots[1:].eq(graphed.store.scratch).all()  # the last batch had one row: the rest is padding
    assert bucket.tail_ids[1:].eq(-1).all() and bucket.tail_pos[1:].eq(-1).all()


def test_the_option_is_a_boolean_and_asks_only_on_cuda():
    """``higgs_frame_graphs`` (a deploy stage's ``hf_overrides``): anything but true/false is refused with its value;
    unset, false, or a head off CUDA captures nothing."""
    from types import SimpleNamespace

    head = torch.nn.Linear(H, C * V, bias=False)
    slots = _slots(torch.device("cpu"))
    for value in ("true", 1, None):
        with pytest.raises(ValueError, match=f"higgs_frame_graphs must be true or false, got {value!r}"):
            FrameGraphs.if_asked(SimpleNamespace(higgs_frame_graphs=value), frame, slots, head, 4, AUDIO)
    for config in (
        SimpleNamespace(),
        SimpleNamespace(higgs_frame_graphs=False),
        SimpleNamespace(higgs_frame_graphs=True),
    ):
        assert FrameGraphs.if_asked(config, frame, slots, head, 4, AUDIO) is None  # the last: a CPU head


@pytest.mark.parametrize(("max_batch", "sizes"), [(64, [1, 2, 16]), (16, [1, 2, 16]), (8, [1, 2]), (1, [1])])
def test_without_graphs_the_eager_frame_meets_each_kernel_class_once_and_leaves_every_slot_as_it_was(max_batch, sizes):
    """``FrameGraphs.warm_eager``: the frame runs once per batch of ``WARM_SIZES`` up to ``max_batch``, every row a
    fresh stream in the scratch slot, with top-k and top-p on; the live requests' slots and the scratch slot's state
    are as before (the frame's own check of its kernels, on CUDA, is ``heads.fused``'s)."""
    dev = torch.device("cpu")
    head, slots = _head(dev), _slots(dev)
    frame(slots, head, *_batch(slots, ["a", "b"], 0, dev))  # two live streams
    before, calls = _state(slots), []

    def recorded(s, h, step_slots, hidden, tail_ids, tail_pos, params):
        calls.append((step_slots.tolist(), tail_ids.tolist(), [p.tolist() for p in params]))
        return frame(s, h, step_slots, hidden, tail_ids, tail_pos, params)

    FrameGraphs(recorded, slots, head, [1, 2, 4], max_batch, AUDIO).warm_eager(H, torch.float32, dev)
    assert [len(c[0]) for c in calls] == sizes
    for (step_slots, tail_ids, (t, k, p)), n in zip(calls, sizes, strict=True):
        assert step_slots == [slots.store.scratch] * n and tail_ids == [AUDIO] * n
        assert t == [1.0] * n and k == [50] * n and p == pytest.approx([0.95] * n)
    after = _state(slots)
    for a, b in zip(after[:-1], before[:-1], strict=True):  # the store's state and row counts, scratch included
        assert torch.equal(a, b)
    live = [slots.requests[r].slot for r in "ab"]
    assert torch.equal(after[-1][live], before[-1][live])  # seed_pos: the scratch slot's is the warm-up's own


@pytest.mark.gpu
def test_frame_graphs_replay_the_eager_frame_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    head = _head(dev)
    graphed, eager = _slots(dev), _slots(dev)
    graphs = FrameGraphs(frame, graphed, head, [1, 2, 4, 8, 16], max_batch=16, open_token=AUDIO)
    graphs.capture(H, torch.float32, dev)
    assert graphs.sizes == (1, 2, 4, 8, 16) and not graphs.failed
    ids = [f"r{i}" for i in range(11)]
    for step in range(12):
        batch = ids[: 11 - (step % 4) * 3]  # 11, 8, 5, 2 rows: buckets 16, 8, 8, 2
        got = graphs.run(*_batch(graphed, batch, step, dev))
        want = frame(eager, head, *_batch(eager, batch, step, dev))
        assert torch.equal(got, want), step
    assert graphs.replays == 12
    for a, b in zip(_state(graphed), _state(eager), strict=True):
        live = [graphed.requests[r].slot for r in ids]
        assert torch.equal(a[live], b[live])

    calls = []

    def drifting(*args):  # a different frame on every call: the capture check must refuse every bucket
        calls.append(1)
        out = frame(*args)
        return out + len(calls)

    broken = FrameGraphs(drifting, _slots(dev), head, [1, 4], max_batch=4, open_token=AUDIO)
    broken.capture(H, torch.float32, dev)
    assert broken.sizes == () and set(broken.failed) == {1, 4}


@pytest.mark.gpu
def test_the_eager_warm_up_checks_every_frame_kernel_on_cuda(monkeypatch):
    """On CUDA ``warm_eager`` leaves each of the frame's Triton kernels checked against its reference and in use
    (``heads.fused``), for the batch sizes it ran."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from higgs_talker.heads import fused

    monkeypatch.setattr(fused, "_checked", {})
    monkeypatch.setattr(fused, "_state", {})
    dev = torch.device("cuda")
    FrameGraphs(frame, _slots(dev), _head(dev), [1, 2, 4, 8, 16], 16, AUDIO).warm_eager(H, torch.float32, dev)
    for name in ("sampler race", "delay mask", "delay state update"):  # the race draws a sampled step's noise
        assert fused.state(name) == "ok", name
    (mask_signatures,) = [sigs for name, sigs in fused._checked.items() if name == "delay mask"]
    assert sorted(sig[0][1][0] for sig in mask_signatures) == [1, 2, 16]  # the logits' batch of each warm-up run


def test_the_score_probe_ranks_replayed_steps_without_advancing_them_twice(monkeypatch):
    """The plugin suites' score probe (tests/vllm_plugin/score_probe) under frame graphs, whose replays run no
    Python: it ranks each step with the eager frame first and puts the slots back, so the replayed results are those
    of a run without the probe, and every published row has its scores (fails without the put-back, or without the
    eager ranking: no row would be recorded)."""
    from pathlib import Path
    from types import SimpleNamespace

    import higgs_talker.heads.slots as slots_module

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "vllm_plugin" / "score_probe"))
    import higgs_score_probe

    monkeypatch.setattr(slots_module, "sample_codes", slots_module.sample_codes)  # restored after the probe's wrap
    monkeypatch.setattr(FrameGraphs, "run", FrameGraphs.run)
    dev = torch.device("cpu")
    head = _head(dev)
    graphed, eager = _slots(dev), _slots(dev)
    real_codes = slots_module.sample_codes

    def unprobed(run):  # the probe's sampler wrapper left out (a replay runs no Python; nor is the reference probed)
        wrapped, slots_module.sample_codes = slots_module.sample_codes, real_codes
        try:
            return run()
        finally:
            slots_module.sample_codes = wrapped

    class Replay(_Replay):
        def replay(self) -> None:
            unprobed(super().replay)

    graphs, _ = _emulated(graphed, head, Replay)
    recorded = higgs_score_probe.record_scores(SimpleNamespace(slots=graphed))
    ids, rows = ["a", "b", "c"], {k: [] for k in "abc"}
    for step in range(4):
        got = graphs.run(*_batch(graphed, ids, step, dev))
        want = unprobed(lambda s=step: frame(eager, head, *_batch(eager, ids, s, dev)))
        assert torch.equal(got, want), step
        graphed.record_later(ids, got.clone())
        for k, row in zip(ids, want, strict=True):
            if row[C]:  # a valid row
                rows[k].append(row[:C].long())
    graphed.settle()
    assert graphs.replays == 4
    for k in ids:
        record = higgs_score_probe.as_record(k, recorded[k])
        assert len(rows[k]) == 4 and torch.equal(record["rows"], torch.stack(rows[k]))
        assert record["scaled"].shape == (4, C, V)
