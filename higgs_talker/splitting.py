"""Long input: a text cut at sentence boundaries into parts that each fit one prompt, and a cap on the frames a
part may take, from its characters, so that no part runs on to ``max_frames``.

Pure host functions; ``HiggsTalker.generate`` / ``stream`` / ``stream_audio`` use them with ``split=``, and the
speech server uses them for every request.

The frame cap (``frame_budget``) is twice the time a slow speaker needs for the text plus two seconds: a Latin,
Cyrillic, Greek... character (letters, digits, spaces, punctuation) counts 1/8 s (people read English aloud at
about 15 characters a second), a CJK ideograph, kana or Hangul syllable 2/5 s (about 5 a second spoken). At 25
frames a second that is ``50 + ceil(3.125 * chars)`` frames for English text.
"""

from __future__ import annotations

import math
import re
import unicodedata

DEFAULT_PART_CHARS = 300  # about 20 s of English speech: a prompt of a few hundred tokens and ~500 frames
SLACK_SECONDS = 2.0
SECONDS_PER_CHAR = 1 / 8  # twice the time of ~15 characters a second
SECONDS_PER_WIDE_CHAR = 2 / 5  # twice the time of ~5 CJK characters a second

# A sentence ends at . ! ? and their full-width / CJK forms, or an ellipsis, with any closing quotes or
# brackets after them, followed by whitespace (or, after a full-width mark, by anything).
_SENTENCE_END = re.compile(r"(?:[.!?…]+[\"'”’)\]]*\s+|[。！？]+[」』”’）]*\s*)")
_CLAUSE_END = re.compile(r"(?:[,;:—–]+\s+|[，；：、]+\s*)")
_SPACE = re.compile(r"\s+")


def _is_wide(ch: str) -> bool:
    """CJK ideographs, kana, Hangul and their full-width punctuation: one character is about a syllable."""
    o = ord(ch)
    return (
        0x3000 <= o <= 0x9FFF  # CJK punctuation, kana, CJK unified ideographs (and extension A)
        or 0xAC00 <= o <= 0xD7AF  # Hangul syllables
        or 0xF900 <= o <= 0xFAFF  # CJK compatibility ideographs
        or 0xFF00 <= o <= 0xFFEF  # full-width forms
        or 0x20000 <= o <= 0x3FFFF  # CJK extensions B and later
    )


def frame_budget(text: str, frame_rate: int) -> int:
    """The most frames a part speaking ``text`` is allowed: ``frame_rate`` x (2 s + 1/8 s a character, 2/5 s a
    CJK / kana / Hangul character)."""
    wide = sum(1 for ch in text if _is_wide(ch))
    seconds = SLACK_SECONDS + SECONDS_PER_CHAR * (len(text) - wide) + SECONDS_PER_WIDE_CHAR * wide
    return math.ceil(seconds * frame_rate)


def _pieces(text: str, pattern: re.Pattern) -> list[str]:
    """``text`` cut after every match of ``pattern`` (the separator stays with the piece before it)."""
    out, start = [], 0
    for m in pattern.finditer(text):
        out.append(text[start : m.end()])
        start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out


ZWJ = "\u200d"  # zero-width joiner


def _fit(piece: str, max_chars: int) -> list[str]:
    """A piece cut into runs of at most ``max_chars`` (whitespace at their ends not counted): at clauses, then at
    spaces, then anywhere."""
    if len(piece.strip()) <= max_chars:
        return [piece]
    for pattern in (_CLAUSE_END, _SPACE):
        parts = _pieces(piece, pattern)
        if len(parts) > 1:
            return _pack([run for p in parts for run in _fit(p, max_chars)], max_chars)
    return _hard_cuts(piece, max_chars)


def _hard_cuts(piece: str, max_chars: int) -> list[str]:
    """A run with no space or mark cut every ``max_chars`` characters, each cut moved back so that it does not fall
    inside a character a reader sees as one (a letter and its combining accents, an emoji sequence joined by
    U+200D, a variation selector or skin tone); a cluster longer than ``max_chars`` is cut where it must be."""
    runs, start = [], 0
    while len(piece) - start > max_chars:
        end = start + max_chars
        while end > start + 1 and _inside_cluster(piece, end):
            end -= 1
        if end == start + 1 and _inside_cluster(piece, end):
            end = start + max_chars
        runs.append(piece[start:end])
        start = end
    return [*runs, piece[start:]]


def _inside_cluster(text: str, k: int) -> bool:
    """Whether cutting ``text`` before index ``k`` splits what is displayed as one character."""
    after, before = text[k], text[k - 1]
    return (
        unicodedata.category(after).startswith("M")  # a combining mark belongs to what precedes it
        or after == ZWJ
        or before == ZWJ
        or "\ufe00" <= after <= "\ufe0f"  # variation selectors
        or "\U0001f3fb" <= after <= "\U0001f3ff"  # skin tones
        or "\U000e0020" <= after <= "\U000e007f"  # emoji tag sequences
    )


def _pack(pieces: list[str], max_chars: int) -> list[str]:
    """Consecutive pieces joined while the run stays within ``max_chars``."""
    runs: list[str] = []
    for p in pieces:
        if runs and len((runs[-1] + p).strip()) <= max_chars:
            runs[-1] += p
        else:
            runs.append(p)
    return runs


def split_text(text: str, max_chars: int = DEFAULT_PART_CHARS) -> list[str]:
    """``text`` as parts of at most ``max_chars`` characters each, cut at sentence ends where it can (then at
    clause marks, then at spaces, a run without any of them anywhere), consecutive sentences packed together;
    whitespace around each part is stripped and blank parts dropped. A text within ``max_chars`` is one part.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"max_chars must be an integer >= 1, got {max_chars!r}")
    text = text.strip()
    if len(text) <= max_chars:
        return [text] if text else []
    runs = _pack([run for s in _pieces(text, _SENTENCE_END) for run in _fit(s, max_chars)], max_chars)
    return [r.strip() for r in runs if r.strip()]
