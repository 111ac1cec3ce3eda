"""When a request stops, and the text it shows: EOS / stop token ids, and stop strings matched on decoded text.

:class:`StopRule` is what the engine asks, for every resolved token, whether the request ends there
(``runtime/engine/step_outputs.py``). With stop strings it keeps a :class:`TextStream` of the request's output: an
incremental detokenizer (a few tokens of context are decoded again each time, so a multi-token character or a
word-piece joins correctly, and text that ends in an incomplete UTF-8 sequence is held back) whose ``text`` is cut
before the first stop string and never shows it. Stream consumers read ``TextStream.ready``: the text that can no
longer change, holding back a tail that could still become the start of a stop string.
"""

from __future__ import annotations

from typing import Any

from runtime.engine.sampling import SamplingParams

REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class TextStream:
    """The decoded text of a growing list of token ids, with optional stop strings.

    Parameters
    ----------
    tokenizer : a ``tokenizers.Tokenizer`` (``decode(ids)``)
    stop : stop strings (empty: none)
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string appeared; ``text`` ends right before it
        self._prefix = 0  # ids[_prefix:_read] decode to the context that new text is measured against
        self._read = 0

    def push(self, token: int) -> bool:
        """Add one token; True when a stop string completed (the text is cut before it and frozen)."""
        if self.stopped:
            return True
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        now = self.tokenizer.decode(self.ids[self._prefix :])
        if now.endswith(REPLACEMENT) or len(now) <= len(before):  # incomplete character, or nothing new yet
            return False
        start = len(self.text)
        self.text += now[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        if self.stop:
            horizon = max(0, start - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, horizon) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        return self.stopped

    def ready(self, final: bool = False) -> str:
        """The text that will not change: all of it when ``final`` or stopped, else without a tail that is
        the start of a stop string."""
        if final or self.stopped or not self.stop:
            return self.text
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return self.text[: len(self.text) - hold]


class StopRule:
    """Whether a request ends at a token: an EOS id (unless ``ignore_eos``), one of ``stop_token_ids``, or a stop
    string completed in the decoded text (needs a tokenizer)."""

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int], tokenizer: Any = None):
        self.ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        self.text = TextStream(tokenizer, params.stop) if params.stop and tokenizer is not None else None
        self.matched: str | None = None  # "token" or "string" once the request stopped

    def hit(self, token: int) -> bool:
        if self.matched is not None:
            return True
        if self.text is not None and self.text.push(token):
            self.matched = "string"
        elif token in self.ids:
            self.matched = "token"
        return self.matched is not None
