"""Conversation templates: how a list of messages ({"role": system|user|assistant, "content"})
becomes the text a chat model reads.

Two kinds, as MindSpeed-LLM users know them:

- ``--prompt-type NAME``: one of TEMPLATES (empty, alpaca, chatml, qwen, qwen3, llama2, llama3,
  deepseek2, deepseek2-lite, deepseek3, gemma, glm4_moe, cpm, plm), written here;
- a Hugging Face ``chat_template`` (tokenizer_config.json's, or the folder's
  chat_template.jinja), rendered by jinja2's immutable sandbox as transformers renders it: the
  template language runs, Python attribute access and mutation of the messages do not.

Both render to text with the special tokens spelled out; that text is encoded without the
tokenizer adding its own (a template writes the beginning-of-sequence token itself).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from mindspeed_core.data.tokenizer import _read_config, _token_text, encode_plain
from mindspeed_core.errors import MindSpeedError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Template:
    """A conversation format. ``user``/``system``/``assistant`` hold ``{content}``;
    ``generation`` is what asks the model for its turn (after the last user message); an
    assistant turn of the history is ``generation`` + ``assistant``. ``stop`` ends a reply
    (besides the tokenizer's end of document)."""

    name: str
    user: str
    assistant: str
    generation: str = ""
    system: str = "{content}"
    default_system: str | None = None
    begin: str = ""
    stop: tuple[str, ...] = ()
    first_user: str | None = None  # the first user message right after a system message (llama2: inside one [INST])
    # the end of a reply is learnt, not written: the next turn's marker follows the reply in the
    # text, and fine-tuning's label there is the end of document (LLaMA-Factory's efficient_eos,
    # as MindSpeed-LLM's GLM templates set it); the last reply gets the end of document itself
    efficient_eos: bool = False
    # the tokenizer's beginning-of-sequence token first, whatever its text (MindSpeed-LLM's
    # format_prefix bos_token); encode_conversation writes its id
    bos: bool = False

    @property
    def writes_reply_end(self) -> bool:
        """Whether the text ends each reply (a stop text, or the next turn with efficient_eos);
        if not, the tokenizer's end of document does (encode_conversation)."""
        return bool(self.stop)

    def labels(self, ids: list[int], assistant: list[bool], eod: int, ignore: int) -> tuple[list[int], list[int]]:
        """(input ids, labels) for fine-tuning from encode_conversation's: the assistant's tokens
        are learnt; with efficient_eos, the end of document at the token after each reply (and
        appended after the last)."""
        labels = [i if a else ignore for i, a in zip(ids, assistant)]
        if not self.efficient_eos:
            return ids, labels
        for j in range(1, len(ids)):
            if assistant[j - 1] and not assistant[j]:
                labels[j] = eod
        return ids + [eod], labels + [eod]

    def segments(self, messages: list[dict], add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        """The rendered text in pieces, each (text, written by the assistant): the pieces a
        fine-tuning loss trains on are the assistant's."""
        check_messages(messages)
        out = [(self.begin, False)] if self.begin else []
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else self.default_system
        if system is not None:
            out.append((self.system.format(content=system), False))
        first = system is not None and self.first_user is not None
        for m in messages:
            if m["role"] == "user":
                out.append(((self.first_user if first else self.user).format(content=m["content"]) + self.generation,
                            False))
                first = False
            elif m["role"] == "assistant":
                out.append((self.assistant.format(content=m["content"]), True))
        if not add_generation_prompt and out and not out[-1][1] and self.generation:
            text, _ = out.pop()  # the last user turn without the request for a reply
            out.append((text[:-len(self.generation)], False))
        return [(t, a) for t, a in out if t]

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(t for t, _ in self.segments(messages, add_generation_prompt))


_CHATML = dict(system="<|im_start|>system\n{content}<|im_end|>\n", user="<|im_start|>user\n{content}<|im_end|>\n",
               generation="<|im_start|>assistant\n", assistant="{content}<|im_end|>\n", stop=("<|im_end|>",))

TEMPLATES = {t.name: t for t in (
    Template("empty", user="{content}", assistant="{content}"),
    Template("alpaca", user="### Instruction:\n{content}\n\n", generation="### Response:\n", assistant="{content}\n\n",
             default_system="Below is an instruction that describes a task. Write a response that appropriately "
                            "completes the request.\n\n"),
    Template("chatml", **_CHATML),
    Template("qwen", default_system="You are a helpful assistant.", **_CHATML),
    Template("qwen3", **_CHATML),  # --enable-thinking false: choose() adds Qwen3's empty thought to each reply
    # Llama 2 chat (as LLaMA-Factory and MindSpeed-LLM write it): the system prompt inside the first [INST]
    Template("llama2", system="<s>[INST] <<SYS>>\n{content}\n<</SYS>>\n\n", first_user="{content} [/INST]",
             user="<s>[INST] {content} [/INST]", assistant="{content}</s>", stop=("</s>",)),
    Template("llama3", begin="<|begin_of_text|>",
             system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
             user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
             generation="<|start_header_id|>assistant<|end_header_id|>\n\n", assistant="{content}<|eot_id|>",
             stop=("<|eot_id|>",)),
    # DeepSeek's, as MindSpeed-LLM writes them: each reply ends with the end of document
    *(Template(name, begin="<｜begin▁of▁sentence｜>", system="{content}\n\n", user="User: {content}\n\nAssistant:",
               assistant="{content}") for name in ("deepseek2", "deepseek2-lite")),
    Template("deepseek3", begin="<｜begin▁of▁sentence｜>", user="<｜User｜>{content}<｜Assistant｜>", assistant="{content}"),
    # GLM-4.5's, as MindSpeed-LLM writes it: a reply ends where the next turn's marker starts
    Template("glm4_moe", begin="[gMASK]<sop>", system="<|system|>\n{content}", user="<|user|>\n{content}",
             generation="<|assistant|>", assistant="\n{content}", stop=("<|user|>", "<|observation|>"),
             efficient_eos=True),
    # PLM's, as MindSpeed-LLM writes it: ChatML turns with Qwen's default system message; its stop word
    # replaces the end of document (replace_eos), which here ends each reply as it is
    Template("plm", default_system="You are a helpful assistant.", system=_CHATML["system"], user=_CHATML["user"],
             generation=_CHATML["generation"], assistant=_CHATML["assistant"]),
    # CPM's (MindSpeed-LLM's Seed-OSS fine-tuning lines): the tokenizer's beginning of sequence, then
    # "<用户>" before each user message and "<AI>" after it; each reply ends with the end of document
    Template("cpm", user="<用户>{content}<AI>", assistant="{content}", bos=True),
    # Ling-V2's (MindSpeed-LLM's bailing_mini): role tags, each turn closed by <|role_end|>; the end of
    # document after each reply (efficient_eos)
    Template("bailing_mini", system="<role>SYSTEM</role>{content}<|role_end|>",
             user="<role>HUMAN</role>{content}<|role_end|>", generation="<role>ASSISTANT</role>",
             assistant="{content}<|role_end|>", stop=("<|endoftext|>",), efficient_eos=True),
    # Gemma (as its own chat template writes it): turns of user and model, no system role (a
    # system message opens the first user turn)
    Template("gemma", begin="<bos>", system="<start_of_turn>user\n{content}\n\n", first_user="{content}<end_of_turn>\n",
             user="<start_of_turn>user\n{content}<end_of_turn>\n", generation="<start_of_turn>model\n",
             assistant="{content}<end_of_turn>\n", stop=("<end_of_turn>",)),
)}


def encode_conversation(tokenizer, template, messages: list[dict],
                        add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
    """A conversation's tokens, and for each whether the assistant wrote it (what fine-tuning
    trains on). Each piece of the template is encoded alone, without the tokenizer's own
    special tokens; a reply of a template without a stop text ends with the end of document,
    which is what generation stops at. Chat prompts and instruction data are encoded alike."""
    ids, assistant = [], []
    if getattr(template, "bos", False) and tokenizer.bos is not None:
        ids, assistant = [tokenizer.bos], [False]
    for text, by_assistant in template.segments(messages, add_generation_prompt):
        piece = encode_plain(tokenizer, text)
        if by_assistant and not template.writes_reply_end:
            piece.append(tokenizer.eod)
        ids += piece
        assistant += [by_assistant] * len(piece)
    return ids, assistant


def check_messages(messages: list[dict]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise MindSpeedError(f"message {i} must be {{'role': one of {', '.join(ROLES)}, 'content': text}}, "
                                 f"got {str(m)[:80]}")
        if m["role"] == "system" and i:
            raise MindSpeedError(f"message {i}: a system message may only come first")


class HFTemplate:
    """A Hugging Face chat template (jinja2), with the special tokens of its
    tokenizer_config.json as variables."""

    def __init__(self, source: str, tokens: dict[str, str], where: str):
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise MindSpeedError("a Hugging Face chat template needs the 'jinja2' package: "
                                 "pip install 'mindspeed-core[hf]'") from None
        self._error = TemplateError
        self.name, self.tokens, self.stop = f"the chat template of {where}", tokens, ()
        self.writes_reply_end = True  # Hugging Face templates write their end-of-turn tokens

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(fmt):
            import datetime

            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # transformers' settings
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise MindSpeedError(f"{self.name} does not parse: {exc}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        check_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.tokens)
        except self._error as exc:  # SecurityError is one of them: the sandbox refused
            raise MindSpeedError(f"{self.name}: {exc}") from None

    def segments(self, messages: list[dict], add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        """As Template.segments. An assistant message's piece is what rendering the
        conversation up to it adds to the rendering that asks for it (add_generation_prompt);
        that needs each shorter conversation to render as the beginning of the longer one,
        which a template that rewrites earlier turns (dropping their reasoning, say) breaks:
        refused then, since no one could say which tokens are the assistant's."""
        whole = self.render(messages, add_generation_prompt)
        out, done = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            asked = self.render(messages[:i], True)
            said = self.render(messages[:i + 1], False)
            if not (asked.startswith(whole[:done]) and said.startswith(asked) and whole.startswith(said)):
                raise MindSpeedError(f"{self.name} renders the conversation before message {i} differently once it "
                                     "goes on, so the assistant's tokens cannot be told apart: use --prompt-type")
            out += [(asked[done:], False), (said[len(asked):], True)]
            done = len(said)
        out.append((whole[done:], False))
        return [(t, a) for t, a in out if t]


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def hf_template(folder: str) -> HFTemplate | None:
    """The chat template of a tokenizer folder (chat_template.jinja, else tokenizer_config.json's
    chat_template: a string, or a list of named ones of which "default" is taken), or None."""
    config = _read_config(os.path.join(folder, "tokenizer_config.json"))
    source, where = config.get("chat_template"), os.path.join(folder, "tokenizer_config.json")
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as fh:
            source, where = fh.read(), jinja_file
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    tokens = {k: _token_text(config.get(k)) or "" for k in SPECIAL_TOKENS}
    return HFTemplate(source, tokens, where)


def add_args(group, default: str) -> None:
    """--prompt-type and --hf-chat-template, the flags that pick a template (``default``: what
    is used without them)."""
    group.add_argument("--prompt-type", default=None,
                       help=f"the conversation template: one of {', '.join(TEMPLATES)} ({default})")
    group.add_argument("--hf-chat-template", action="store_true",
                       help="use the tokenizer folder's Hugging Face chat template (required to exist)")


def choose(prompt_type: str | None, hf_chat_template: bool, tokenizer_folder: str | None,
           enable_thinking: bool | None = None):
    """The template a chat or an instruction dataset uses: --prompt-type NAME, else the
    tokenizer folder's chat template (required by --hf-chat-template), else ``empty``.
    ``enable_thinking`` False (--enable-thinking false, Qwen3): each reply starts after an empty
    thought, as Qwen3's own template writes it when thinking is off."""
    if prompt_type is not None and hf_chat_template:
        raise MindSpeedError("give either --prompt-type or --hf-chat-template, not both")
    if prompt_type == "magistral":  # a reasoning template not written here: the matrix's row says so
        from mindspeed_core import features, runtime

        features.refuse("magistral-template", runtime.resolve(None))
    if enable_thinking is not None and prompt_type != "qwen3":
        raise MindSpeedError("--enable-thinking applies to --prompt-type qwen3")
    if prompt_type is not None:
        if prompt_type not in TEMPLATES:
            raise MindSpeedError(f"unknown --prompt-type {prompt_type!r}; choose one of {', '.join(TEMPLATES)}")
        chosen = TEMPLATES[prompt_type]
        if enable_thinking is False:
            chosen = dataclasses.replace(chosen, generation=chosen.generation + "<think>\n\n</think>\n\n")
        return chosen
    found = hf_template(tokenizer_folder) if tokenizer_folder and os.path.isdir(tokenizer_folder) else None
    if found is None and hf_chat_template:
        raise MindSpeedError(f"--hf-chat-template: {tokenizer_folder or 'the tokenizer'} has no chat template "
                             "(tokenizer_config.json's chat_template, or chat_template.jinja)")
    return found or TEMPLATES["empty"]
