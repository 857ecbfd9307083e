"""`TextStream`: the text of a growing token sequence, released in safe pieces.

Tokens arrive a verification step at a time. Their text is decoded again as a whole (a token's
text can depend on its neighbours: byte-level pieces, SentencePiece spaces), and only the part
that can no longer change is released: text ending in an incomplete UTF-8 character (U+FFFD) is
held back, and so is any tail that could still become a stop sequence. A stop sequence ends the
text before it, as OpenAI's API does (the decoder's own stop strings keep it, as `generate` does).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.ids: list[int] = []
        self.sent = 0  # characters of the text released so far
        self.stopped = False  # a stop sequence was found: nothing more is released

    def add(self, ids: Sequence[int]) -> str:
        """Take more tokens; returns the newly released text (maybe empty)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The sequence has ended: release what was held back (up to a stop sequence)."""
        return "" if self.stopped else self._release(final=True)

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._decoded()[: self.sent]

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _release(self, final: bool) -> str:
        text = self._decoded()
        end = len(text)
        if (cut := first_stop(text, self.stop, self.sent)) is not None:
            end, self.stopped = cut, True
        elif not final:
            while end > self.sent and text[end - 1] == REPLACEMENT:
                end -= 1
            end -= max((_held(text[:end], s) for s in self.stop), default=0)
        end = max(end, self.sent)
        piece, self.sent = text[self.sent : end], end
        return piece


def first_stop(text: str, stops: Sequence[str], sent: int = 0) -> int | None:
    """Where `text` ends at its first stop sequence, or None. The first is the one *completed*
    first, as generation ends there (the engine stops at the token that completes a stop string);
    of those completed at the same place, the one starting earliest. So the cut does not depend on
    how the tokens arrived: a longer stop that starts earlier but would complete later never
    completes. Only stops ending after the `sent` characters already released can be new."""
    found = [(i + len(s), i) for s in stops if (i := text.find(s, max(0, sent - len(s) + 1))) >= 0]
    return min(found)[1] if found else None


def _held(text: str, stop: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
