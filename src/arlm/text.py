"""Streaming text out of generated token ids: valid UTF-8 pieces, cut at stop strings.

`TextStreamer` is the one place the Python API (`LLM.stream`) and the HTTP API turn one
request's tokens into text as they arrive.
"""

from __future__ import annotations

from .tokenizer import IncrementalDetokenizer, Tokenizer


class StopStrings:
    """Finds stop strings in streamed text and holds back a tail that might start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text = ""  # all text so far (before truncation)
        self.emitted = 0  # chars of self.text already released
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, piece: str, final: bool) -> tuple[str, bool]:
        """Add text; return (text safe to release now, whether a stop string was hit)."""
        self.text += piece
        if self.stops:
            # Search from just before the unreleased text: a stop string can straddle the edge.
            start = max(0, self.emitted - max(map(len, self.stops)) + 1)
            hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stops) if i >= 0]
            if hits:
                at, self.matched = min(hits, key=lambda h: h[0])
                cut = max(at, self.emitted)
                out, self.emitted = self.text[self.emitted:cut], cut
                self.text = self.text[:cut]
                return out, True
        end = len(self.text)
        if not final:
            for s in self.stops:  # hold back the longest tail that is a prefix of a stop string
                for n in range(min(len(s) - 1, len(self.text) - self.emitted), 0, -1):
                    if self.text.endswith(s[:n]):
                        end = min(end, len(self.text) - n)
                        break
        out, self.emitted = self.text[self.emitted:end], end
        return out, False


class TextStreamer:
    """One request's text: `push(token_id, final)` returns the text that token completes (held
    back while a character's bytes are still arriving or a stop string may be starting) and
    whether a stop string ended the text; the text is then cut before the stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | tuple[str, ...] = ()) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = StopStrings(list(stop))
        self.stopped = False

    def push(self, token_id: int, final: bool = False) -> tuple[str, bool]:
        """final: this is the request's last token (flush whatever is held back)."""
        piece = self.detokenizer.push(token_id) + (self.detokenizer.flush() if final else "")
        text, hit = self.stops.push(piece, final)
        self.stopped = self.stopped or hit
        return text, hit

    @property
    def text(self) -> str:
        """All text so far, cut at a stop string if one was hit."""
        return self.stops.text
