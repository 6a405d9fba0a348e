"""Long input in the Python API: ``splitting.split_text`` / ``frame_budget``, and ``generate`` / ``stream`` /
``stream_audio`` with ``split=`` on the tiny checkpoint; ``prepare`` (split and tokenized once) and the ways a
``stream_audio`` ends early (closed, or its ``cancel`` event set)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _engine_invariants import assert_idle, remember_idle

from higgs_talker import GenerationCancelled, HiggsTalker, Reference, SamplingParams
from higgs_talker.splitting import DEFAULT_PART_CHARS, frame_budget, split_text

LONG = " ".join(f"Sentence {i} of a text that no single prompt could hold, said in order." for i in range(70))


def test_split_text_cuts_at_sentence_ends_and_packs_them() -> None:
    text = "One. Two! Three? Four."
    assert split_text(text, 100) == [text]
    assert split_text(text, 10) == ["One. Two!", "Three?", "Four."]
    assert split_text("  Padded.  ", 100) == ["Padded."]
    assert split_text("   ", 10) == []
    assert split_text("「こんにちは。」元気ですか？はい。", 9) == ["「こんにちは。」", "元気ですか？はい。"]
    quoted = 'He said "stop." Then he left. (Quietly.) End.'
    assert split_text(quoted, 20) == ['He said "stop."', "Then he left.", "(Quietly.) End."]
    assert split_text("Mr. Smith is here.", 10) == ["Mr.", "Smith is", "here."]  # abbreviations are no guard
    assert split_text("Is it? Yes it is.", 12) == ["Is it?", "Yes it is."]  # a question ends a sentence


def test_split_text_falls_back_to_clauses_spaces_and_hard_cuts() -> None:
    assert split_text("alpha beta, gamma delta; epsilon", 12) == ["alpha beta,", "gamma delta;", "epsilon"]
    assert split_text("aaaa bbbb cccc dddd", 9) == ["aaaa bbbb", "cccc dddd"]
    assert split_text("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]


@pytest.mark.parametrize("max_chars", [1, 7, 40, DEFAULT_PART_CHARS])
def test_split_text_keeps_every_word_in_order_within_the_limit(max_chars: int) -> None:
    parts = split_text(LONG, max_chars)
    assert all(0 < len(p) <= max_chars for p in parts)
    assert "".join(parts).replace(" ", "") == LONG.replace(" ", "")


def test_split_text_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="text must be a str"):
        split_text(b"bytes")
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="max_chars"):
            split_text("a", bad)


def test_frame_budget() -> None:
    assert frame_budget("", 25) == 50  # the 2 s of slack
    assert frame_budget("x" * 80, 25) == 50 + 250  # 1/8 s a character
    assert frame_budget("字" * 10, 25) == 50 + 100  # 2/5 s a CJK character
    assert frame_budget("x", 25) == 50 + 4  # ceil(3.125) frames: a part of a character rounds up
    assert frame_budget("가" * 10, 25) == 50 + 100  # Hangul syllables are wide too
    english = "The quick brown fox jumps over the lazy dog."
    assert frame_budget(english, 25) >= 2 * 25 * len(english) / 15  # twice a reader's 15 characters a second


@pytest.fixture(scope="module")
def talker(tiny_dir) -> HiggsTalker:
    return remember_idle(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024))


def test_a_text_longer_than_a_prompt_is_spoken_in_parts(talker: HiggsTalker) -> None:
    with pytest.raises(ValueError, match="prompt is"):
        talker.generate(LONG, max_frames=20)
    params = SamplingParams(seed=5, max_frames=20)
    result = talker.generate(LONG, params, split=True)
    texts = split_text(LONG)
    assert len(result.parts) == len(texts) > 1 and [p.text for p in result.parts] == texts
    assert torch.equal(result.codes, torch.cat([p.codes for p in result.parts]))
    assert result.text == LONG and all(p.seed == 5 for p in result.parts)
    assert result.prompt_tokens == sum(p.prompt_tokens for p in result.parts)
    for part, text in zip(result.parts, texts, strict=True):  # each part alone: the same codes
        alone = talker.generate(text, params)
        assert torch.equal(part.rows, alone.rows)
    frames = list(talker.stream(LONG, params, split=True))
    assert torch.equal(torch.stack(frames), result.codes)
    audio = torch.cat(list(talker.stream_audio(LONG, params, split=True)))
    torch.testing.assert_close(audio, result.audio, rtol=0, atol=1e-5)
    assert_idle(talker)


def test_each_part_is_capped_from_its_text(talker: HiggsTalker) -> None:
    text = "Short one. " + "A second sentence, a good deal longer. " * 2
    greedy = SamplingParams(temperature=0.0)  # greedy on random weights runs on to the cap
    result = talker.generate(text, greedy, split=45)
    texts = split_text(text, 45)
    assert texts == ["Short one.", "A second sentence, a good deal longer.", "A second sentence, a good deal longer."]
    for part, t in zip(result.parts, texts, strict=True):
        assert part.finish_reason == "max_frames" and part.num_frames == frame_budget(t, 25)
    assert result.finish_reason == "max_frames"
    capped = talker.generate(text, greedy, max_frames=40, split=45)  # a smaller max_frames wins
    assert [p.num_frames for p in capped.parts] == [40, 40, 40]
    assert_idle(talker)


@pytest.mark.parametrize("text", ["  Hello there.\n", "\n\nPara one.\n\nPara two.\n", "\tTabbed. "])
def test_a_text_within_one_part_keeps_its_whitespace_as_upstream_does(talker: HiggsTalker, text: str) -> None:
    """vllm-omni's /v1/audio/speech tokenizes ``input`` as given (tts_adapters/higgs_audio_v3.py:57, no strip, no
    split): a text that needs no cut is prompted verbatim, leading and trailing newlines and spaces included (they
    are tokens of the prompt); only the cut parts of a long text are stripped. Nor is it capped from its text: its
    sampling is the request's (upstream caps it only by its token limit)."""
    params = SamplingParams(seed=1, max_frames=1000)
    part = talker.prepare(text, params, split=True).parts[0]
    assert part.prompt.input_ids.tolist() == talker.build_prompt(text).input_ids.tolist()
    assert part.text == text and part.sampling == params and frame_budget(text.strip(), 25) < 1000


def test_split_draws_one_seed_for_all_parts_and_keeps_the_voice(talker: HiggsTalker) -> None:
    voice = Reference(codes=torch.randint(0, 1024, (20, 8), generator=torch.Generator().manual_seed(0)), text="Hi.")
    result = talker.generate(LONG[:400], SamplingParams(max_frames=10), reference=voice, split=True)
    assert len({p.seed for p in result.parts}) == 1 and len(result.parts) == 2
    again = talker.generate(LONG[:400], SamplingParams(seed=result.seed, max_frames=10), reference=voice, split=True)
    assert torch.equal(again.codes, result.codes)
    assert all(p.prompt_tokens > len(talker.build_prompt(p.text)) for p in result.parts)  # the voice is in each
    assert_idle(talker)


def test_split_batches_several_texts_and_closing_a_stream_frees_every_part(talker: HiggsTalker) -> None:
    results = talker.generate([LONG[:400], "Just one."], SamplingParams(seed=2, max_frames=10), split=True)
    assert len(results[0].parts) == 2 and len(results[1].parts) == 1
    assert results[1].codes.shape == results[1].parts[0].codes.shape
    stream = talker.stream(LONG, SamplingParams(seed=1, temperature=0.0), split=True)
    next(stream)
    assert len(talker.engine.requests) == 2  # this part and the next, queued alongside
    stream.close()
    deadline = time.monotonic() + 10
    while talker.engine.scheduler._unpublished and time.monotonic() < deadline:  # the step running when it closed
        time.sleep(0.01)
    assert_idle(talker)


def wait_for_the_step_in_flight(talker: HiggsTalker) -> None:
    deadline = time.monotonic() + 10
    while talker.engine.scheduler._unpublished and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_prepared_text_is_tokenized_once_and_streams_as_the_text(talker: HiggsTalker, monkeypatch) -> None:
    built: list[str] = []
    real_build = talker.tokenizer.build
    monkeypatch.setattr(talker.tokenizer, "build", lambda text, *a: built.append(text) or real_build(text, *a))
    voice = Reference(codes=torch.randint(0, 1024, (20, 8), generator=torch.Generator().manual_seed(1)), text="Hi.")
    text, params = LONG[:400], SamplingParams(max_frames=10)  # no seed: prepare draws one for both parts
    prepared = talker.prepare(text, params, voice, split=True)
    texts = split_text(text)
    assert built == texts and [p.text for p in prepared.parts] == texts and prepared.text == text
    assert len({p.sampling.seed for p in prepared.parts}) == 1 and prepared.parts[0].sampling.seed is not None
    audio = torch.cat(list(talker.stream_audio(prepared)))
    frames = torch.stack(list(talker.stream(prepared)))
    assert built == texts  # streamed twice, tokenized once
    seeded = SamplingParams(seed=prepared.parts[0].sampling.seed, max_frames=10)
    result = talker.generate(text, seeded, voice, split=True)
    assert torch.equal(frames, result.codes) and prepared.prompt_tokens == result.prompt_tokens
    torch.testing.assert_close(audio, torch.cat(list(talker.stream_audio(text, seeded, voice, split=True))))
    for extra in ({"sampling": params}, {"reference": voice}, {"max_frames": 5}, {"split": True}):
        with pytest.raises(ValueError, match=f"give it alone, not with {next(iter(extra))}"):
            next(talker.stream_audio(prepared, **extra))
    assert_idle(talker)


def test_stream_audio_closed_or_cancelled_frees_its_requests_at_once(talker: HiggsTalker) -> None:
    greedy = SamplingParams(seed=3, temperature=0.0)  # runs on to each part's cap: far longer than the test
    chunks = talker.stream_audio(LONG, greedy, split=True)
    next(chunks)
    assert len(talker.engine.requests) == 2  # this part and the next, queued alongside
    chunks.close()
    assert not talker.engine.requests  # slots and KV blocks free when close() returns
    wait_for_the_step_in_flight(talker)
    assert_idle(talker)

    cancel = threading.Event()
    chunks = talker.stream_audio(LONG, greedy, split=True, cancel=cancel)
    next(chunks)
    assert len(talker.engine.requests) == 2
    threading.Thread(target=cancel.set).start()  # set elsewhere, as a server's event loop does
    with pytest.raises(GenerationCancelled, match=r"cancelled after \d+ frames"):
        for _ in chunks:
            pass
    assert not talker.engine.requests
    wait_for_the_step_in_flight(talker)
    assert_idle(talker)
    # an event that is never set changes nothing
    short = SamplingParams(seed=3, max_frames=15)
    with_event = torch.cat(list(talker.stream_audio("Hello there.", short, cancel=threading.Event())))
    assert torch.equal(with_event, torch.cat(list(talker.stream_audio("Hello there.", short))))


@pytest.mark.parametrize("audio", [False, True], ids=["stream", "stream_audio"])
def test_a_cancelled_request_still_queued_behind_others_is_freed_at_once(tiny_dir, audio: bool) -> None:
    """Every decode slot taken: the cancelled request waits in the queue and makes no frame, yet it is dropped at
    the next engine step (a server's client that gave up costs no slot and no prefill later); the running one goes
    on to the same codes as alone."""
    talker = remember_idle(HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=1, max_model_len=1024))
    greedy = SamplingParams(seed=3, temperature=0.0, min_frames=400, max_frames=400)
    alone = torch.stack(list(talker.stream("Hold the only slot.", greedy)))
    holder = talker.stream("Hold the only slot.", greedy)
    held = [next(holder)]  # running: the one slot is taken
    cancel, errors = threading.Event(), []

    def queued() -> None:
        frames = (talker.stream_audio if audio else talker.stream)("Wait in line.", greedy, cancel=cancel)
        try:
            next(frames)
        except GenerationCancelled as exc:
            errors.append(exc)

    waiter = threading.Thread(target=queued)
    waiter.start()
    deadline = time.monotonic() + 10
    while len(talker.engine.scheduler.waiting) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(talker.engine.scheduler.waiting) == 1, "the second request should wait for the slot"
    cancel.set()
    held.append(next(holder))
    waiter.join(timeout=10)
    assert not waiter.is_alive() and len(errors) == 1 and "cancelled after 0 frames" in str(errors[0])
    # woken by its cancel, at the next step: not by the holder's end freeing the slot (the frames it waits for)
    assert [r.finished for r in talker.engine.requests.values()] == [False]
    assert not talker.engine.scheduler.waiting and len(talker.engine.requests) == 1  # only the holder is left
    held.extend(holder)
    assert torch.equal(torch.stack(held), alone)
    wait_for_the_step_in_flight(talker)
    assert_idle(talker)


def test_prepare_refuses_a_prompt_that_leaves_no_room_before_anything_is_queued(tiny_dir) -> None:
    """``prepare`` (the server's check of a request) holds each part's prompt to the engine's max_model_len, the
    rule the engine applies when it queues it: a part too long is refused there, not later in the worker."""
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=1, max_model_len=64)
    long = "Hi there my friend. " * 4  # one part of more than 64 prompt tokens
    with pytest.raises(ValueError, match=r"prompt of \d+ tokens leaves no room within max_model_len=64"):
        talker.prepare(long)
    with pytest.raises(ValueError, match="max_model_len=64"):
        next(talker.stream(long))
    assert not talker.engine.requests
    assert len(talker.prepare("Hi.").parts) == 1  # one that fits


@pytest.mark.parametrize("bad", [0, -3, 1.5, "yes"])
def test_split_refuses_bad_values(talker: HiggsTalker, bad) -> None:
    with pytest.raises(ValueError, match="split must be"):
        talker.generate("Hello.", split=bad)
    with pytest.raises(ValueError, match="empty"):
        talker.generate("   ", split=True)


@pytest.mark.parametrize(
    "cluster",
    ["\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466", "e\u0301", "\u2764\ufe0f", "\U0001f44d\U0001f3fd"],
    ids=["zwj-family", "combining-accent", "variation-selector", "skin-tone"],
)
def test_a_run_without_spaces_is_cut_between_clusters(cluster: str) -> None:
    """A run with nowhere to cut is cut every max_chars characters, but never inside what a reader sees as one
    character (a family emoji was cut after a zero-width joiner, leaving one part ending in U+200D)."""
    text = cluster * 120
    for max_chars in (10, 33, 100):
        parts = split_text(text, max_chars)
        assert "".join(parts) == text and all(len(p) <= max_chars for p in parts)
        assert all(len(p) % len(cluster) == 0 for p in parts), [len(p) for p in parts]  # whole clusters only


def test_a_cluster_longer_than_max_chars_is_cut_at_max_chars() -> None:
    """Where one displayed character is longer than ``max_chars`` (a 7-code-point family emoji, 3 allowed), no cut
    can avoid it: each is cut every ``max_chars`` code points (3 + 3 + 1), not into single code points."""
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466"
    parts = split_text(family * 2, 3)
    assert "".join(parts) == family * 2
    assert [len(p) for p in parts] == [3, 3, 1, 3, 3, 1]
