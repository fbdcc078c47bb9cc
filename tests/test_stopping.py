"""Incremental stop detection (:class:`dspine.core.stopping.StopDetector`) against the plain
definition: the output ends at the first prefix whose decoded text holds a stop string."""
from __future__ import annotations

import random

import pytest

from dspine.core.stopping import StopDetector


def naive_first_stop(tok, ids, start, end, stop):
    for k in range(start + 1, end + 1):
        if any(s in tok.decode(ids[:k], skip_special_tokens=True) for s in stop):
            return k
    return None


def run_blocks(det_cls, tok, ids, stop, rng):
    """Feed ``ids`` in random blocks as the engine does (first_stop, then advance);
    returns the stop position or None."""
    det = det_cls(tok, stop)
    out: list[int] = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 6)
        start = len(out)
        out += ids[i:i + n]
        i += n
        k = det.first_stop(out, start)
        if k is not None:
            return k
        det.advance(out)
    return None


class NoOverlap(StopDetector):
    """Negative control: searches only the new text, not the confirmed text's last characters."""

    def first_stop(self, ids, start, end=None):
        end = len(ids) if end is None else end
        for k in range(start + 1, end + 1):
            if any(s in self._tail(ids, k) for s in self.stop):
                return k
        return None


def cases(tok, texts, rng, n=60):
    out = []
    for _ in range(n):
        text = rng.choice(texts)
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids, skip_special_tokens=True)
        a = rng.randrange(0, max(1, len(full) - 4))
        stop = [full[a:a + rng.randint(1, 5)]] if rng.random() < 0.8 else ["@@never@@"]
        out.append((ids, stop))
    return out


TEXTS = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint(fib(10))",
         "The quick brown fox jumps over the lazy dog. Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve r\u00e9sum\u00e9!",
         "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 and emoji \U0001F600\U0001F680 mixed with ASCII text.",
         "  leading spaces,\ttabs\n\nand   runs   of   spaces  ."]


def test_same_decision_as_decoding_every_prefix(smol):
    tok = smol.tokenizer
    rng = random.Random(0)
    hits = 0
    for ids, stop in cases(tok, TEXTS, rng):
        want = naive_first_stop(tok, ids, 0, len(ids), stop)
        assert run_blocks(StopDetector, tok, ids, stop, random.Random(len(ids))) == want, (ids, stop)
        hits += want is not None
    assert hits > 20  # the cases do stop


def test_byte_tokens_split_characters(tiny256):
    """Byte tokens: U+FFFD appears while a character is incomplete; a stop on it fires there,
    exactly as the token-by-token decode would."""
    tok = tiny256.tokenizer
    ids = [0x61, 0xC3, 0xA9, 0x62]  # "a", then "é" as two bytes, then "b"
    for stop in (["\ufffd"], ["\u00e9b"], ["a\u00e9"]):
        want = naive_first_stop(tok, ids, 0, len(ids), stop)
        for seed in range(5):
            assert run_blocks(StopDetector, tok, ids, stop, random.Random(seed)) == want


def test_negative_control_misses_a_stop_across_blocks(smol):
    """Without the confirmed text's last characters a stop that spans two blocks is missed:
    the comparison above can fail."""
    tok = smol.tokenizer
    rng = random.Random(0)
    wrong = sum(run_blocks(NoOverlap, tok, ids, stop, random.Random(len(ids)))
                != naive_first_stop(tok, ids, 0, len(ids), stop) for ids, stop in cases(tok, TEXTS, rng))
    assert wrong > 0


def test_first_stop_does_not_change_state_and_refuses_confirmed_start(smol):
    tok = smol.tokenizer
    ids = tok.encode("hello world, hello there", add_special_tokens=False)
    det = StopDetector(tok, ["there"])
    det.advance(ids[:3])
    before = (det.text, det.prefix, det.read)
    assert det.first_stop(ids, 3) == naive_first_stop(tok, ids, 3, len(ids), ["there"])
    assert (det.text, det.prefix, det.read) == before
    with pytest.raises(ValueError, match="before the confirmed text"):
        det.first_stop(ids, 1)
    assert StopDetector(tok, []).first_stop(ids, 0) is None


@pytest.mark.parametrize("text", ["def fibonacci(n):\n    if n == 0:\n        return 0\n    return n",
                                  "abc abc abc abc abc abc abc"])
def test_every_prefix_and_infix_as_a_stop(smol, text):
    """Stops that begin at the very start of the output or are longer than the text confirmed
    so far (a negative slice once dropped the start of a short text: such stops were missed)."""
    tok = smol.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    stops = {full[a:b] for a in range(0, len(full), 3) for b in range(a + 1, min(len(full), a + 24) + 1, 2)}
    for stop in sorted(stops):
        want = naive_first_stop(tok, ids, 0, len(ids), [stop])
        for seed in range(3):
            assert run_blocks(StopDetector, tok, ids, [stop], random.Random(seed)) == want, (stop, seed)
