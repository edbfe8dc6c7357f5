"""`mindspeed generate --task chat`: a conversation on the terminal.

Each line read is the user's message; the reply is generated from the whole conversation
rendered by the template (``--prompt-type`` or the tokenizer's Hugging Face chat template,
data/chat_templates.py) and printed as it is drawn. The last ``--history-turns`` rounds are
kept (and fewer when they would not leave room for ``--max-new-tokens`` in the model's
positions). ``/clear`` forgets the history, ``/exit`` (or the end of input) ends the session;
MindSpeed-LLM's words do the same (EXIT_WORDS, CLEAR_WORDS), so its users' habits carry over.
``--system-prompt`` replaces the template's default system message. Greedy unless
``--do-sample`` (then --temperature/--top-k/--top-p, seeded by --seed).
"""

from __future__ import annotations

import json
import sys

from mindspeed_core import features
from mindspeed_core.data.chat_templates import encode_conversation
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.models import generate as gen
from mindspeed_core.streaming import TextStream


class Session:
    """The conversation: its history, and the reply to each new message."""

    def __init__(self, model, cfg, tokenizer, template, sampling, max_new_tokens: int, history_turns: int,
                 system: str | None = None, use_cache: bool = True):
        self.model, self.cfg, self.tokenizer, self.template = model, cfg, tokenizer, template
        self.sampling, self.max_new_tokens, self.history_turns = sampling, max_new_tokens, history_turns
        self.system, self.use_cache = system, use_cache
        self.stop_ids = (tokenizer.eod,) if getattr(tokenizer, "eod", None) is not None else ()
        self.stops = tuple(template.stop)
        self.rounds: list[tuple[str, str]] = []

    def clear(self) -> None:
        self.rounds = []

    def prompt(self, message: str) -> list[int]:
        """The tokens the model reads before replying to ``message``: as many recent rounds as
        ``--history-turns`` allows and the positions leave room for."""
        kept = self.rounds[len(self.rounds) - min(self.history_turns, len(self.rounds)):]
        while True:
            messages = [{"role": "system", "content": self.system}] if self.system is not None else []
            for user, reply in kept:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            ids, _ = encode_conversation(self.tokenizer, self.template, messages + [{"role": "user", "content": message}],
                                         add_generation_prompt=True)
            wrong = gen.fits(self.cfg.max_position_embeddings, len(ids), self.max_new_tokens, self.cfg.rope_scaling)
            if not wrong:
                return ids
            if not kept:
                raise MindSpeedError(f"this message does not fit: {wrong}; write less, or lower --max-new-tokens")
            kept = kept[1:]

    def reply(self, message: str, speak: bool = False) -> str:
        features.note_used("chat")
        ids = self.prompt(message)
        if speak:
            sys.stdout.write("Assistant> ")
        stream = TextStream(self.tokenizer, speak, self.stops)
        gen.generate(self.model, [ids], self.max_new_tokens, self.sampling, self.stop_ids, self.use_cache,
                     stream.step)
        text = stream.close()
        self.rounds.append((message, text))
        return text


EXIT_WORDS = ("/exit", "q", "exit", "quit")  # a whole line, as MindSpeed-LLM's chat task reads them
CLEAR_WORDS = ("/clear", "clear", "new")


def run(session: Session, speak: bool, as_json: bool, lines=None) -> None:
    """Read messages (from ``lines``, default stdin) until /exit or the end of input."""
    interactive = speak and not as_json and sys.stdin.isatty() and lines is None
    # the terminal's bytes, decoded a line at a time: a line that is not UTF-8 is refused alone
    lines = getattr(sys.stdin, "buffer", sys.stdin) if lines is None else lines
    if interactive:
        print("chat: /clear (or clear, new) forgets the conversation, /exit (or q, exit, quit) ends it")
    while True:
        if interactive:
            sys.stdout.write("You> ")
            sys.stdout.flush()
        line = lines.readline()
        if not line:
            break
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                print(f"error: that message is not UTF-8 text (byte 0x{line[exc.start]:02x}); write it again",
                      file=sys.stderr)
                continue
        message = line.rstrip("\n")
        command = message.strip()
        if command in EXIT_WORDS:
            break
        if command in CLEAR_WORDS:
            session.clear()
            if speak and not as_json:
                print("(history cleared)")
            continue
        if not command:
            continue
        try:
            text = session.reply(message, speak=speak and not as_json)
        except MindSpeedError as exc:  # the session goes on
            print(f"error: {exc}", file=sys.stderr)
            continue
        if speak and as_json:
            print(json.dumps({"user": message, "reply": text}, ensure_ascii=False))
