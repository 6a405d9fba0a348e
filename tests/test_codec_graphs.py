"""The codec's streamed decodes through captured graphs (``cuda_graphs.codec``), on CPU with a stand-in for the
capture (``_stand_in_graphs``: a replay runs the decode again on the static inputs) and a stand-in timer:
which shapes replay a graph, padding to a batch bucket and pieces above the largest, results that are copies,
and every way a shape is left to eager decodes (a replay unlike eager, a slower graph, a capture that raises).
``tests/test_gpu.py`` captures real graphs. Also the window lengths a chunking rule decodes."""

from __future__ import annotations

import itertools
import logging
import random
from pathlib import Path

import pytest
import torch
from _stand_in_graphs import ReplayedGraph, stand_in_capture
from safetensors.torch import load_file
from test_codec import decode_tolerance, rel_err

from higgs_talker import HiggsTalker, SamplingParams
from higgs_talker.checkpoint import CODEC_PREFIX
from higgs_talker.codec import FAST_START_CHUNKING, UPSTREAM_CHUNKING, AudioChunking, Codec, next_window
from higgs_talker.codec.streaming import window_lengths
from higgs_talker.cuda_graphs.codec import CodecGraphs, capture_stream_graphs

HOP = 960


@pytest.fixture(scope="module")
def codec(tiny_dir: Path) -> Codec:
    return Codec.from_pretrained(tiny_dir)


def random_codes(frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1024, (frames, 8), generator=torch.Generator().manual_seed(seed))


class Recorder:
    """A stand-in capture that keeps its graphs (to count replays) and may perturb what a replay computes."""

    def __init__(self, perturb: float = 0.0, raises: BaseException | None = None, empty: bool = False) -> None:
        self.graphs: dict[tuple, ReplayedGraph] = {}
        self.perturb, self.raises, self.empty = perturb, raises, empty  # empty: replays change nothing
        self.marks: dict[tuple, int] = {}

    def __call__(self, fn, pool=None, mode="global"):
        assert mode == "thread_local"  # the engine's thread may be stepping while a codec captures
        if self.raises is not None:
            raise self.raises
        graph, out = stand_in_capture(lambda: fn() + self.perturb if self.perturb else fn(), pool)
        if self.empty:  # a capture that recorded nothing (the work ran eagerly elsewhere): out keeps what it holds
            graph.replay = lambda: None
        self.graphs[tuple(out.shape)] = graph
        return graph, out

    def mark(self) -> None:
        """From here on, count replays from zero (capturing replays each graph to check and to time it)."""
        self.marks = {shape: g.replays for shape, g in self.graphs.items()}

    def replays(self) -> dict[tuple, int]:
        """Output shape -> replays since ``mark``, for the graphs replayed."""
        counts = {shape: g.replays - self.marks.get(shape, 0) for shape, g in self.graphs.items()}
        return {shape: n for shape, n in counts.items() if n}


def graphs_for(codec: Codec, capture, graph_faster: bool = True) -> CodecGraphs:
    timer = iter([])

    def timed(fn) -> float:  # eager is timed first, then the graph
        nonlocal timer
        fn()
        return next(timer, 0.0)

    graphs = CodecGraphs(codec.model.decode, codec.num_quantizers, codec.codebook_size, codec.device,
                         capture=capture, timer=timed)  # fmt: skip
    times = [2.0, 1.0] if graph_faster else [1.0, 2.0]
    original = graphs._capture_one

    def capture_one(batch, frames):
        nonlocal timer
        timer = iter(times)
        return original(batch, frames)

    graphs._capture_one = capture_one
    return graphs


@pytest.fixture
def with_graphs(codec):
    """The codec with stand-in graphs for windows of 11, 36 and 45 frames (the default chunking's without its ramp),
    batches 1-8."""
    recorder = Recorder()
    codec.graphs = graphs_for(codec, recorder)
    report = codec.graphs.capture([11, 36, 45])
    recorder.mark()
    yield codec, recorder, report
    codec.graphs = None


def alone(codec: Codec, codes: torch.Tensor, front: int, back: int) -> torch.Tensor:
    return codec.decode(codes)[front * HOP : (codes.shape[0] - back) * HOP]


# ----------------------------------------------------------------------------------------- window lengths


def _lengths_of_a_long_stream(rule: AudioChunking, frames: int = 400) -> list[int]:
    lengths, emitted = [], 0
    for available in range(1, frames + 1):
        window = next_window(available, emitted, False, rule)
        if window is not None:
            lengths.append(window.end - window.start)
            emitted = window.emit_end
    return lengths


def test_window_lengths_are_the_ones_a_stream_decodes():
    """The default rule (ramped chunks of 1, 1, 2, 4, 8, 16, then 25 frames) decodes windows of 11, 12, 14, 18, 26,
    36, then 45 frames; without the ramp 11, 36, 45; upstream's 5, 30, then 54; fast start's 3, 16, 22, 32, 44, 45;
    for small and random rules, ramped or not, the list holds exactly the lengths a long stream's windows have (its
    last one aside), first ones first."""
    assert window_lengths(AudioChunking().resolved((10, 10))) == [11, 12, 14, 18, 26, 36, 45]
    assert window_lengths(AudioChunking(ramp=False).resolved((10, 10))) == [11, 36, 45]
    assert window_lengths(UPSTREAM_CHUNKING.resolved((10, 10))) == [5, 30, 54]
    assert window_lengths(FAST_START_CHUNKING.resolved((10, 10))) == [3, 16, 22, 32, 44, 45]
    with pytest.raises(ValueError, match="left_context_frames, holdback_frames of .*resolved"):  # left to the codec
        window_lengths(AudioChunking())
    assert window_lengths(UPSTREAM_CHUNKING) == [5, 30, 54]  # every size given (the first holdback is the holdback)
    small = itertools.product(range(1, 6), range(1, 6), range(5), range(4), [None, *range(6)], [False, True])
    for chunk, first, left, hold, first_hold, ramp in small:  # every small rule: a longer first holdback catches up
        if first <= chunk:
            rule = AudioChunking(chunk, first, left, hold, first_hold, ramp).resolved((10, 10))
            assert window_lengths(rule) == list(dict.fromkeys(_lengths_of_a_long_stream(rule, 120))), rule
    rng = random.Random(0)
    for _ in range(400):
        chunk = rng.randint(1, 40)
        first_hold = rng.choice([None, rng.randint(0, 12)])
        rule = AudioChunking(chunk, rng.randint(1, chunk), rng.randint(0, 30), rng.randint(0, 12), first_hold,
                             rng.random() < 0.5)  # fmt: skip
        rule = rule.resolved((10, 10))
        seen = _lengths_of_a_long_stream(rule)
        assert window_lengths(rule) == list(dict.fromkeys(seen)), rule


# ----------------------------------------------------------------------------------------- replays


def test_streamed_chunks_replay_graphs_and_equal_eager_decodes(with_graphs):
    """A stream of 100 frames under the default chunking without its ramp decodes every window but the last through a
    graph, and its chunks equal those of the same stream decoded eagerly."""
    codec, recorder, report = with_graphs
    assert set(report) == {(b, t) for b in (1, 2, 4, 8) for t in (11, 36, 45)}
    assert all(v.startswith("graph") for v in report.values()), report
    codes = random_codes(100, seed=3)

    def chunks() -> list[torch.Tensor]:
        decoder = codec.stream(AudioChunking(ramp=False))
        out = [decoder.push(frame) for frame in codes]
        return [c for c in [*out, decoder.finish()] if c is not None]

    graphed = chunks()
    assert recorder.replays() == {(1, 1, 11 * HOP): 1, (1, 1, 36 * HOP): 1, (1, 1, 45 * HOP): 2}
    graphs, codec.graphs = codec.graphs, None
    eager = chunks()
    codec.graphs = graphs
    assert len(graphed) == len(eager) == 5
    for got, want in zip(graphed, eager, strict=True):
        assert torch.equal(got, want)


def test_a_batch_is_padded_to_its_bucket_and_split_above_the_largest(with_graphs, tensors_tol):
    """Three windows of 36 frames replay the 4-window graph; ten of 45 replay the 8- and the 2-window graphs;
    windows of a length with no graph decode eagerly. Each window's samples are its lone decode's."""
    codec, recorder, _ = with_graphs
    windows = [(random_codes(36, seed=i), 10, 10) for i in range(3)]
    windows += [(random_codes(45, seed=10 + i), 10, 10) for i in range(10)]
    windows += [(random_codes(20, seed=30 + i), 5, 5) for i in range(2)]
    got = codec.decode_windows(windows)
    assert recorder.replays() == {(4, 1, 36 * HOP): 1, (8, 1, 45 * HOP): 1, (2, 1, 45 * HOP): 1}
    for (codes, front, back), wav in zip(windows, got, strict=True):
        want = alone(codec, codes, front, back)
        assert wav.shape == want.shape and rel_err(wav, want) <= tensors_tol


def test_a_decode_returns_a_copy_that_the_next_replay_leaves_alone(with_graphs):
    """Also outside inference mode (vllm-omni's Stage 1 decodes under no_grad): the static inputs take the codes."""
    codec, _, _ = with_graphs
    a, b = random_codes(45, seed=1), random_codes(45, seed=2)
    first = codec.decode_windows([(a, 0, 0)])[0]
    codec.decode_windows([(b, 0, 0)])
    assert torch.equal(first, codec.decode(a))
    with torch.no_grad():
        again = codec.graphs.decode(a.t()[None])
    assert again is not None and torch.equal(again.reshape(-1), first)


# ----------------------------------------------------------------------------------------- left to eager


def test_a_replay_unlike_eager_leaves_its_shape_to_eager_decodes_with_one_warning(codec, caplog):
    """A graph whose replay differs from an eager decode of the same codes (here by 1e-6) is dropped with one
    warning per shape; those windows then decode eagerly, exactly as without graphs."""
    codec.graphs = graphs_for(codec, Recorder(perturb=1e-6))
    try:
        with caplog.at_level(logging.WARNING, logger="higgs_talker.cuda_graphs.codec"):
            report = codec.graphs.capture([11], batches=(1, 2))
            assert codec.graphs.capture([11], batches=(1, 2)) == {}  # tried once
        assert codec.graphs.captured == []
        assert all("replay differs from an eager decode" in v for v in report.values()), report
        assert len(caplog.records) == 2
        codes = random_codes(11, seed=4)
        assert torch.equal(codec.decode_windows([(codes, 0, 1)])[0], alone(codec, codes, 0, 1))
    finally:
        codec.graphs = None


def test_a_graph_that_recorded_nothing_is_not_kept(codec):
    """A capture whose replay computes nothing (its output still holds what the capture's run left there) is
    caught: the check replays it on other codes than the capture saw."""
    graphs = graphs_for(codec, Recorder(empty=True))
    report = graphs.capture([11], batches=(1, 2))
    assert graphs.captured == [] and all("replay differs" in v for v in report.values()), report


def test_the_talker_is_held_idle_for_a_capture(talker):
    """``Driver.held_idle`` (what a codec capture holds): False at once while another caller's request runs; with
    ``wait``, True once it has ended, and a request asked for during the block waits until the block ends."""
    import threading
    import time

    first = threading.Thread(target=lambda: talker.generate("held idle", SamplingParams(seed=1, min_frames=60,
                                                                                           max_frames=60)))  # fmt: skip
    first.start()
    while talker._driver._thread is None and first.is_alive():
        time.sleep(0.001)
    with talker._driver.held_idle(wait=False) as idle:
        assert not idle
    done = []
    with talker._driver.held_idle(wait=True) as idle:
        assert idle
        later = threading.Thread(target=lambda: done.append(talker.generate("later", SamplingParams(max_frames=3))))
        later.start()
        time.sleep(0.5)
        assert not done  # waits for the block
    later.join(60)
    first.join(60)
    assert done and done[0].codes.shape[0] >= 1


def test_a_graph_slower_than_eager_is_not_kept(codec):
    graphs = graphs_for(codec, Recorder(), graph_faster=False)
    report = graphs.capture([11], batches=(1,))
    assert graphs.captured == [] and report[(1, 11)].startswith("eager (faster"), report


def test_a_capture_that_raises_leaves_its_shape_to_eager_decodes(codec, caplog):
    codec.graphs = graphs_for(codec, Recorder(raises=RuntimeError("operation not permitted when stream is capturing")))
    try:
        with caplog.at_level(logging.WARNING, logger="higgs_talker.cuda_graphs.codec"):
            report = codec.graphs.capture([11, 36], batches=(1,))
        assert codec.graphs.captured == [] and len(caplog.records) == 2
        assert all("operation not permitted" in v for v in report.values()), report
        codes = random_codes(36, seed=5)
        assert torch.equal(codec.decode_windows([(codes, 10, 10)])[0], alone(codec, codes, 10, 10))
    finally:
        codec.graphs = None


def test_nothing_is_captured_on_the_cpu_or_in_eager_mode(talker):
    """``capture_stream_graphs`` is for CUDA; the CPU talker (graph mode eager) prepares its codec only."""
    assert capture_stream_graphs(talker.codec, [11]) is None
    assert talker.prepare_audio() is None and talker.codec.graphs is None


@pytest.fixture(scope="module")
def tensors_tol(tiny_dir: Path) -> float:
    """Twice the float32 decode tolerance of the tiny codec (batched decodes round unlike lone ones)."""
    raw = load_file(str(tiny_dir / "model.safetensors"))
    tensors = {k[len(CODEC_PREFIX) :]: v for k, v in raw.items() if k.startswith(CODEC_PREFIX)}
    return 2 * decode_tolerance(tensors, torch.float32)


# ----------------------------------------------------------------------------------------- CUDA (the H200)


def _prefer_graphs(fn) -> float:
    """A timer under which every checked graph is kept (eager is timed first): the tests below then replay real
    graphs whatever the timings; ``capture_stream_graphs`` times them for real."""
    fn()
    _prefer_graphs.calls = getattr(_prefer_graphs, "calls", 0) + 1
    return 1.0 if _prefer_graphs.calls % 2 else 0.0


@pytest.fixture(scope="module")
def cuda_codec() -> Codec:
    """The real codec's shape (``HIGGS_V3_CODEC``, random weights) on CUDA, decode only, float32."""
    from higgs_talker.codec import HIGGS_V3_CODEC

    return Codec.from_config(HIGGS_V3_CODEC, encoder=False, device="cuda")


@pytest.mark.gpu
def test_real_graphs_replay_the_eager_decodes_of_the_full_codec(cuda_codec):
    """Graphs of the 4B codec's decodes (the default chunking's window lengths, batches 1-8), each checked at
    capture: a window decoded through one equals its eager decode bit for bit at the same batch, one window alone
    and ten windows in pieces of 8 and 2; the timed capture of ``capture_stream_graphs`` fails no shape."""
    codec = cuda_codec
    codec.graphs = CodecGraphs(codec.model.decode, 8, 1024, codec.device, timer=_prefer_graphs)
    try:
        report = capture_stream_graphs(codec, [11, 36, 45])
        assert set(report) == {(b, t) for b in (1, 2, 4, 8) for t in (11, 36, 45)}
        assert codec.graphs.captured == sorted(report), report
        for t in (11, 36, 45):
            codes = random_codes(t, seed=t)
            want = codec.model.decode(codes.cuda().t()[None]).float().reshape(-1)[10 * HOP :]
            assert torch.equal(codec.decode_windows([(codes, 10, 0)])[0], want), t
        batch = torch.stack([random_codes(45, seed=50 + i).t() for i in range(10)]).cuda()  # [10, Q, T]
        want = torch.cat([codec.model.decode(batch[:8]), codec.model.decode(batch[8:])]).float()
        got = codec.decode_windows([(codes.t().cpu(), 0, 0) for codes in batch])
        assert all(torch.equal(g, w.reshape(-1)) for g, w in zip(got, want, strict=True))
    finally:
        codec.graphs = None
    report = capture_stream_graphs(codec, [11, 45], batches=(1, 4))  # timed for real
    print("\n".join(f"{b} x {t} frames: {v}" for (b, t), v in sorted(report.items())))
    assert all(v.startswith(("graph (", "eager (faster")) for v in report.values()), report
    codec.graphs = None


@pytest.mark.gpu
def test_stream_audio_through_codec_graphs_equals_eager_decodes_and_captures_wait_for_an_idle_talker(tiny_dir):
    """A CUDA talker's streamed audio is the same with its codec's window decodes replayed from graphs as decoded
    eagerly (one stream: the same batch of one); ``prepare_audio`` for another chunking, asked for while another
    thread's requests step, waits for them to end (a capture needs the GPU to itself) and then captures, and those
    requests' codes are the ones a quiet run gives."""
    import threading
    import time

    talker = HiggsTalker.from_pretrained(tiny_dir, device="cuda")
    codec = talker.codec
    codec.graphs = CodecGraphs(codec.model.decode, codec.num_quantizers, codec.codebook_size, codec.device,
                               timer=_prefer_graphs)  # fmt: skip
    assert talker.prepare_audio() and codec.graphs.captured
    replays, decode = [], codec.graphs.decode

    def counted(codes):
        wav = decode(codes)
        if wav is not None:
            replays.append(tuple(codes.shape))
        return wav

    codec.graphs.decode = counted
    params = SamplingParams(seed=11, min_frames=90, max_frames=90)  # the ramp's windows, 45, the last (43: eager)
    graphed = list(talker.stream_audio("Streaming through graphs.", params))
    assert replays == [(1, 8, t) for t in (11, 12, 14, 18, 26, 36, 45)], replays
    graphs, codec.graphs = codec.graphs, None
    graphs.decode = decode
    eager = list(talker.stream_audio("Streaming through graphs.", params))
    assert len(graphed) == len(eager) and all(torch.equal(g, e) for g, e in zip(graphed, eager, strict=True))

    codec.graphs = graphs
    texts = [f"request {i} while the codec captures" for i in range(6)]
    seeded = [SamplingParams(seed=i, min_frames=120, max_frames=120) for i in range(6)]
    quiet = [r.rows for r in talker.generate(texts, seeded)]
    got, errors = [], []

    def step() -> None:
        try:
            got.extend(r.rows for r in talker.generate(texts, seeded))
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    worker = threading.Thread(target=step)
    worker.start()
    while talker._driver._thread is None and worker.is_alive():
        time.sleep(0.001)
    assert worker.is_alive()
    report = talker.prepare_audio(AudioChunking(chunk_frames=7))  # windows of 11-18, then 25 and 27 frames: new
    assert len(got) == 6  # the requests had ended before the capture began
    worker.join(timeout=300)
    assert not errors and report, (errors, report)
    assert not [v for v in report.values() if "failed" in v], report
    assert all(torch.equal(g, q) for g, q in zip(got, quiet, strict=True))
