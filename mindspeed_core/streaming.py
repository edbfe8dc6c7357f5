"""A reply printed as its tokens are drawn (`mindspeed generate --stream`, `--task chat`)."""

from __future__ import annotations

import sys


class TextStream:
    """A reply's text as its tokens come. The decoded text grows; what is new is printed,
    except a tail that could still become a stop text (or an unfinished character of a
    byte-level tokenizer). ``step`` returns True once a stop text has appeared."""

    def __init__(self, tokenizer, speak: bool, stops=()):
        self.tokenizer, self.speak, self.stops = tokenizer, speak, tuple(stops)
        self.ids, self.shown = [], 0

    def text(self) -> str:
        """The reply so far, cut before the first stop text."""
        text = self.tokenizer.decode(self.ids)
        cuts = [text.find(s) for s in self.stops if s in text]
        return text[:min(cuts)] if cuts else text

    def step(self, tokens) -> bool:
        if tokens[0] is None:
            return False
        self.ids.append(tokens[0])
        text = self.tokenizer.decode(self.ids)
        stopped = any(s in text for s in self.stops)
        text = self.text()
        if not stopped:
            # hold back what may be the start of a stop text, or of a character
            hold = max([n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
            text = text[:len(text) - hold]
            if text.endswith("\ufffd"):
                text = text[:-1]
        self._write(text)
        return stopped

    def close(self) -> str:
        text = self.text()
        self._write(text)
        if self.speak:
            sys.stdout.write("\n")
            sys.stdout.flush()
        return text

    def _write(self, text: str) -> None:
        if self.speak and len(text) > self.shown:
            sys.stdout.write(text[self.shown:])
            sys.stdout.flush()
            self.shown = len(text)
