"""Incremental stop-string detection: each new token costs a decode of a few tokens, not of
the whole output.

The decision is the one the plain one-token loop makes: the output ends at the first
prefix ``out_ids[:k]`` whose decoded text holds a stop string (checked after *each*
token, so a text that holds a stop only transiently, e.g. U+FFFD of a UTF-8 character
split over two byte tokens, stops as it would one token at a time). The text of
``out_ids[:k]`` is built as vLLM's incremental detokenizer builds it: the confirmed text of
``out_ids[:read]`` plus ``decode(out_ids[prefix:k])`` past ``decode(out_ids[prefix:read])``,
where the tokens ``prefix..read`` give the decoder the context that a leading-space or
byte-fallback tokenizer needs; the read offset advances only over text that does not end in
an incomplete character (U+FFFD). Since the confirmed text holds no stop (the request
would have ended), only its last ``max(len(stop)) - 1`` characters and the new text are
searched.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class StopDetector:
    """Per-request state: the confirmed text and the two offsets into the output ids.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=True)``).
        stop: the request's stop strings (empty ones are ignored).
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars of the confirmed text a stop can span
        self.text = ""  # decoded text of ids[:read]
        self.prefix = self.read = 0
        self._prefix_text = ""  # decode(ids[prefix:read]), cached

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _tail(self, ids: list[int], k: int) -> str:
        """The text that ``ids[read:k]`` adds to the confirmed text (may end in U+FFFD)."""
        full = self._decode(ids[self.prefix:k])
        return full[len(self._prefix_text):] if full.startswith(self._prefix_text) else full

    def first_stop(self, ids: list[int], start: int, end: int | None = None) -> int | None:
        """The smallest ``k`` in ``(start, end]`` whose text ``decode(ids[:k])`` holds a stop
        string, or None. ``ids`` is the output so far followed by candidate tokens
        (``start >= read``: the confirmed state covers no token past ``start``). Does not
        change the state (:meth:`Engine.cut_at_finish` asks about proposals)."""
        if not self.stop:
            return None
        end = len(ids) if end is None else end
        if start < self.read:
            raise ValueError(f"first_stop: start {start} is before the confirmed text ({self.read} tokens)")
        before = self.text[-self.hold:] if self.hold else ""  # the whole text while it is shorter
        for k in range(start + 1, end + 1):
            window = before + self._tail(ids, k)
            if any(s in window for s in self.stop):
                return k
        return None

    def advance(self, ids: list[int]) -> None:
        """Confirm the text of ``ids`` (the committed output), up to its last complete character."""
        if len(ids) <= self.read:
            return
        tail = self._tail(ids, len(ids))
        if not tail or tail.endswith(REPLACEMENT):
            return  # an incomplete character: wait for the next token
        self.text += tail
        self._prefix_text = self._decode(ids[self.read:len(ids)])
        self.prefix, self.read = self.read, len(ids)
