"""Incremental detokenization with stop strings: token ids in, text deltas out.

Pure core (no NATS). ``Detokenizer.feed`` takes the generated token ids of a chunk and returns
the text that may be shown now:

- it never returns part of a UTF-8 character: while the decoded tail ends in U+FFFD (a byte
  sequence not complete yet) the text is held back;
- it holds back text that could be the start of a stop string, and reports the first stop string
  that matched, with the text before it (the stop string itself is never returned);
- special tokens (eos, chat markers) are not part of the returned text.

Decoding looks at a short window of tokens (TGI/vLLM-style prefix and read offsets), so a long
output costs O(1) work per token. A chunk is decoded as a whole: two decodes a chunk, not two a
token (a decode call costs microseconds whatever its length: ``bench/detok.py``). Only a chunk
whose text holds a stop string (or, with stop strings, ends inside a character) is decoded again
a token at a time, to cut at the token that completed the match.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

REPLACEMENT = "\ufffd"
"""What a tokenizer decodes an incomplete UTF-8 sequence to."""


class Decoder(Protocol):
    """The part of an HF tokenizer this module uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class Delta:
    """Text to return now; ``stopped`` when a stop string matched (``text`` is the last text and
    the token just fed is the one that completed the stop string)."""

    text: str
    stopped: bool = False
    taken: int = 0
    """Tokens of the chunk taken: all of them, or up to the one that completed a stop string."""


def partial_suffix_len(text: str, patterns: Sequence[str]) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of a pattern: how
    much text must be held back because a pattern may be starting there."""
    longest = 0
    for pattern in patterns:
        for k in range(min(len(pattern) - 1, len(text)), longest, -1):
            if text.endswith(pattern[:k]):
                longest = k
                break
    return longest


class Detokenizer:
    """Turn one output's token ids into text deltas, holding back partial characters and
    possible stop-string starts.

    ``context`` is the tail of the prompt (a few ids): with it, tokenizers that mark word starts
    (SentencePiece) decode the first output token with its leading space.
    """

    def __init__(
        self, tokenizer: Decoder, stop: Sequence[str] = (), context: Sequence[int] = ()
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._pending = ""
        """Decoded text not returned yet: it may be the start of a stop string."""
        self.stopped = False

    def feed(self, token_ids: Sequence[int]) -> Delta:
        """Add generated tokens; return the text that can be shown now. When a stop string
        matched, the tokens after the one that completed it are not taken (``Delta.taken``).
        Without stop strings, a chunk whose text ends in a character not complete yet is held
        back whole until a later chunk completes it (or ``finish``)."""
        if self.stopped:
            raise ValueError("a stop string already matched; feed no more tokens")
        before = (len(self._ids), self._prefix_offset, self._read_offset, self._prefix_text)
        self._ids += token_ids
        delta = self._decoded_delta()  # the whole chunk at once
        if not self._stop or (delta and not any(s in self._pending + delta for s in self._stop)):
            self._pending += delta
            return replace(self._release(), taken=len(token_ids))
        # A stop string is in it, or its text ends inside a character: a token at a time, to
        # find the token that completed the match.
        count, self._prefix_offset, self._read_offset, self._prefix_text = before
        del self._ids[count:]
        text = []
        for taken, token_id in enumerate(token_ids, start=1):
            self._ids.append(token_id)
            self._pending += self._decoded_delta()
            delta = self._release()
            text.append(delta.text)
            if delta.stopped:
                return Delta("".join(text), stopped=True, taken=taken)
        return Delta("".join(text), taken=len(token_ids))

    def finish(self) -> str:
        """Generation ended without a stop string: return everything held back."""
        if self.stopped:
            return ""
        tail = self._decode(self._ids[self._prefix_offset :])[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        text, self._pending = self._pending + tail, ""
        return text

    def _decoded_delta(self) -> str:
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(self._prefix_text) or window.endswith(REPLACEMENT):
            return ""  # nothing new yet, or the last character is not complete
        delta = window[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return delta

    def _release(self) -> Delta:
        if not self._stop:
            text, self._pending = self._pending, ""
            return Delta(text)
        found = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if found:
            self.stopped = True
            text, self._pending = self._pending[: min(found)], ""
            return Delta(text, stopped=True)
        # A stop string cannot start in text already returned: that text would have been held.
        keep = partial_suffix_len(self._pending, self._stop)
        cut = len(self._pending) - keep
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return Delta(text)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)
