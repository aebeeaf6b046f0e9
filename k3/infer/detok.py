"""Incremental detokenisation and stop strings: the text of a growing output at a cost per token that does not
grow with the output's length.

:class:`IncrementalDecoder` decodes only a short window of the newest tokens each time (offsets as in the
tokenizers library's ``DecodeStream``): ``prefix`` marks where the window starts, ``read`` where the text already
returned ends. A token whose bytes end inside a multi-byte UTF-8 character (the window decodes to a trailing
U+FFFD) returns nothing until the character completes; :meth:`flush` returns whatever is left when the output ends,
so the pieces joined equal ``tokenizer.decode(all ids)`` for byte-level tokenizers.

:class:`StopMatcher` holds back the text that may begin a stop string and cuts the output at the first one, looking
only at text not yet returned (a stop string cannot start inside returned text: that text was held while it could).
"""

from __future__ import annotations


class IncrementalDecoder:
    """``push(token_id) -> new text`` (possibly ""), ``flush() -> the rest`` (``tokenizer.decode(ids) -> str``)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window decoded for context starts here
        self.read = 0  # text of ids[:read] has been returned
        self.prefix_text = ""  # decode(ids[prefix:read])

    @property
    def holding(self) -> bool:
        """Whether tokens are pushed whose text is not returned yet (an unfinished character)."""
        return self.read < len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tok.decode(self.ids[self.prefix :])
        if len(text) > len(self.prefix_text) and not text.endswith("\ufffd"):
            return self._advance(text)
        return ""

    def flush(self) -> str:
        """The text of the tokens still held (U+FFFD for an unfinished character, as a full decode shows it)."""
        if not self.holding:
            return ""
        return self._advance(self.tok.decode(self.ids[self.prefix :]))

    def _advance(self, text: str) -> str:
        new = text[len(self.prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        # the next window starts at the tokens just returned: its context text is their own decode
        self.prefix_text = self.tok.decode(self.ids[self.prefix : self.read])
        return new


class StopMatcher:
    """Stop strings over text that arrives in pieces: ``feed(piece, final) -> (text to return now, stopped)``.

    While not final, the last ``max(len(stop)) - 1`` characters are held back (they may begin a stop string); once a
    stop string appears, the text before it is returned and the rest never is. Where several appear in one piece,
    the one that ends first wins, so the result does not depend on how the text was cut into pieces."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""  # decoded, not yet returned

    def feed(self, piece: str, final: bool = False) -> tuple[str, bool]:
        self.pending += piece
        # the stop string that ends first wins (as if the text came a character at a time), then the earliest
        found = [(i + len(s), i) for s, i in ((s, self.pending.find(s)) for s in self.stops) if i >= 0]
        cut = min(found)[1] if found else -1
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        if final or not self.hold:
            out, self.pending = self.pending, ""
            return out, False
        keep = min(self.hold, len(self.pending))
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out, False
