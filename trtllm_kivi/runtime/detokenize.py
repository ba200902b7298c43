"""Incremental detokenization with stop strings: the one place streamed text is made (scheduler requests, hence
run, generate, bench and Triton serving).

Push token ids; `text` is the decoded text cut before the first stop string (then `stopped` is set); `delta()` gives
the text that is safe to show since the last call: it holds back an incomplete multi-byte character and, until the
end, a tail that could still grow into a stop string (it would be cut then)."""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()) -> None:
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer, self.stop_strings = tokenizer, tuple(stop_strings)
        self.tokens: list[int] = []
        self.text = ""  # decoded so far, cut before a stop string; "" without a tokenizer
        self.stopped = False  # a stop string was found
        self._emitted = 0  # characters of text already returned by delta()

    def push(self, token: int) -> None:
        self.tokens.append(token)
        if self.tokenizer is None or self.stopped:
            return
        self.text = self.tokenizer.decode(self.tokens)
        hits = [self.text.find(s) for s in self.stop_strings if s in self.text]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def _stable(self, final: bool) -> str:
        if final or self.stopped:
            return self.text
        text = self.text.rstrip("\ufffd")  # an incomplete multi-byte character decodes to U+FFFD
        hold = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return text[:len(text) - hold]

    def delta(self, final: bool = False) -> str:
        """New text safe to show now (final: everything left, the stream has ended)."""
        stable = self._stable(final)
        out = stable[self._emitted:] if len(stable) > self._emitted else ""
        self._emitted = max(self._emitted, len(stable))
        return out


__all__ = ["Detokenizer"]
