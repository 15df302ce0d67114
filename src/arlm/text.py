"""Streaming text out of generated token ids: valid UTF-8 pieces, cut at stop strings.

`TextStreamer` is the one place the Python API (`LLM.stream`) and the HTTP API turn one
request's tokens into text as they arrive. And the chat templates' rendering (`render_chat`),
as HF transformers renders them: `LLM.apply_chat_template`, `arlm prepare --chat`, and
`arlm generate --chat` without torch (arlm.bare).
"""

from __future__ import annotations

import functools
import json

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


# -- chat templates ---------------------------------------------------------------------------------

class PromptError(ValueError):
    """A prompt or message list the model cannot take (empty, too long)."""


@functools.lru_cache(maxsize=8)
def compile_chat_template(template: str):
    """A Jinja2 chat template compiled as HF transformers does (sandboxed, trimmed blocks); kept,
    since compiling costs ~100x a render (`arlm prepare --chat` renders each conversation
    prefix by prefix)."""
    from jinja2 import TemplateError  # (~70 ms, only where a chat template is rendered)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # HF's filter: plain JSON (Jinja2's own escapes <, > and & for HTML, which templates that
        # list tools would pass on to the model)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise PromptError(f"chat template failed: {e}") from None


def template_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """The special tokens chat templates read (HF's `bos_token`, `eos_token`), as text."""
    return {"bos_token": tokenizer.decode([tokenizer.bos_id]) if tokenizer.bos_id is not None else "",
            "eos_token": tokenizer.decode([tokenizer.eos_id]) if tokenizer.eos_id is not None else ""}


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                **extra: object) -> str:
    """Render a Jinja2 chat template the way HF transformers does (sandboxed, trimmed blocks)."""
    from jinja2 import TemplateError

    compiled = compile_chat_template(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
    except TemplateError as e:
        raise PromptError(f"chat template failed: {e}") from None
    except (TypeError, ValueError, ArithmeticError, LookupError) as e:  # the template's own Python ('a' + 1)
        raise PromptError(f"chat template failed: {type(e).__name__}: {e}") from None
