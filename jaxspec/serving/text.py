"""Incremental text of a growing token list: what may be streamed now, and where a stop string
cuts it. Text is held back while it ends in a split UTF-8 character or in a prefix of a stop
string (so a streamed piece never shows part of a stop string that the next token completes)."""

from __future__ import annotations

import dataclasses


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may still become (part of) a stop string."""
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:n]):
                keep = n
                break
    return keep


@dataclasses.dataclass
class TextState:
    stops: tuple[str, ...]
    shown: int = 0  # characters already streamed

    def advance(self, text: str, final: bool) -> tuple[str, bool]:
        """(the new piece to stream, whether a stop string ended the text). `text`: the whole
        decoded output so far; final: no more tokens will come."""
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            piece = text[self.shown : cut] if cut > self.shown else ""
            self.shown = max(self.shown, cut)
            return piece, True
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # a split multi-byte character: wait for the rest
                end = len(text.rstrip("\ufffd"))
            end = min(end, len(text) - held_back(text, self.stops))
        if end <= self.shown:
            return "", False
        piece = text[self.shown : end]
        self.shown = end
        return piece, False
