"""Token ids in, text pieces out, cut at the first stop sequence (pure; no I/O).

Theory of operation
-------------------
The swarm streams token ids. Text is always decoded from *all* ids so far (a multi-byte
character split across two tokens then comes out whole), and a piece is what the new text adds
beyond what was already shown. Two things are held back instead of shown at once:

* a trailing U+FFFD: half a UTF-8 character whose other half is in the next token;
* a tail of the text that is the beginning of some stop sequence: if the next token completes
  the stop, that text must never have been shown.

When a stop sequence appears (the one completed first, if several), the text is cut before it, the generation is over
(``stopped``), and the caller cancels the swarm's generation. ``completion_tokens`` counts the
tokens received up to and including the one that completed the stop, which is what the model
generated (and what the client is charged in ``usage``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextAssembler:
    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far, before any cut
        self.shown = ""  # what has been handed out
        self.stopped = False
        self.stop_sequence: str | None = None
        self._scanned = 0  # stops were searched for in text[:_scanned]
        self.receipt: dict[str, object] | None = None  # the swarm's receipt, once the generation is done

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)

    def feed(self, ids: Sequence[int]) -> str:
        """Add committed tokens; return the text that may be shown now ("" if none).
        After a stop sequence is found, further calls return "" and ignore their ids."""
        if self.stopped or not ids:
            return ""
        self.ids.extend(int(i) for i in ids)
        self.text = self._decode(self.ids)
        if self.stops:
            start = max(0, self._scanned - self._longest + 1)
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
            self._scanned = len(self.text)
            if hits:
                # the stop that was complete first (per token, as the model wrote it)
                cut, seq = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))
                self.stopped, self.stop_sequence = True, seq
                return self._advance(self.text[:cut])
        return self._advance(self.text[: self._safe_end()])

    def finish(self) -> str:
        """The generation ended: return whatever was held back."""
        if self.stopped:
            return ""
        return self._advance(self.text)

    def _safe_end(self) -> int:
        end = len(self.text)
        while end > 0 and self.text[end - 1] == REPLACEMENT:
            end -= 1
        for k in range(min(self._longest - 1, end), 0, -1):
            tail = self.text[end - k : end]
            if any(s.startswith(tail) for s in self.stops):
                return end - k
        return end

    def _advance(self, upto: str) -> str:
        if not upto.startswith(self.shown) or len(upto) <= len(self.shown):
            # decoding more ids changed earlier text (rare; some tokenizers merge spaces): show
            # nothing now, the rest comes out when the text is consistent again or at finish()
            return ""
        piece = upto[len(self.shown) :]
        self.shown = upto
        return piece
