"""What ``mindspeed preprocess --handler-name NAME`` makes of each record, MindSpeed-LLM's
handlers by name:

- ``GeneralPretrainHandler`` (the default): each ``--json-keys`` text is a document;
- ``AlpacaStyleInstructionHandler`` / ``SharegptStyleInstructionHandler``: a conversation,
  written to ``<prefix>_packed_{input_ids,attention_mask,labels}_document``; the labels are
  the tokens where the assistant wrote them (every assistant turn of a multi-turn record) and
  IGNORE (-100) elsewhere;
- ``AlpacaStylePairwiseHandler`` / ``SharegptStylePairwiseHandler``: one prompt with a chosen
  and a rejected reply (``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``,
  ``rejected_labels``), for DPO, SimPO and reward models;
- ``AlpacaStyleProcessRewardHandler``: a solution whose steps end with ``--placeholder-token``,
  each labelled by one of ``--reward-tokens`` (the ``value`` list): the labels hold that
  token's id at the placeholders and IGNORE elsewhere.

The records' columns are LLaMA-Factory's (Alpaca: instruction, input, output, system,
history, chosen, rejected; ShareGPT: conversations of {from, value} with the tags human, gpt,
observation, function_call, system), renamed by ``--map-keys`` JSON. Tool calls
(function_call) count as the assistant's turns and tool results (observation) as the
user's, their text passed through. A record that does not have this shape is an error
naming its file and line, not a silent skip.
"""

from __future__ import annotations

import json

from mindspeed_core.data.chat_templates import encode_conversation
from mindspeed_core.data.tokenizer import encode_plain
from mindspeed_core.errors import MindSpeedError

IGNORE = -100  # a label that no loss counts (MindSpeed-LLM's and transformers' IGNORE_INDEX)

ALPACA_KEYS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
               "history": "history", "chosen": "chosen", "rejected": "rejected"}
SHAREGPT_KEYS = {"messages": "conversations", "system": "system", "tools": "tools", "chosen": "chosen",
                 "rejected": "rejected"}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
PRM_KEYS = {"input": "input", "value": "value"}


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise MindSpeedError(f"{where}: {what} is {'missing' if value is None else type(value).__name__}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON's "\ud800" escapes decode to a lone surrogate
        raise MindSpeedError(f"{where}: {what} holds a lone surrogate ({value[exc.start]!r} at character "
                             f"{exc.start}), which is not text any tokenizer can encode") from None
    return value


def one_token(tok, text: str, flag: str, where: str = "") -> int:
    """The id of ``text``, which must be a single token (a placeholder, a step label)."""
    ids = encode_plain(tok, text)
    if len(ids) != 1:
        raise MindSpeedError(f"{where + ': ' if where else ''}{flag} {text!r} is {len(ids)} tokens for this "
                             f"tokenizer; it must be one")
    return ids[0]


def _columns(given: dict, defaults: dict, style: str, extra: tuple = ()) -> dict:
    """--map-keys checked: known columns only, each mapped to a column name (or null: absent)."""
    unknown = sorted(set(given) - set(defaults) - set(extra))
    if unknown:
        raise MindSpeedError(f"--map-keys: {', '.join(map(repr, unknown))} is not a column of {style} data; "
                             f"the columns are {', '.join(defaults)}" + (f" and {', '.join(extra)}" if extra else ""))
    for key, value in given.items():
        if key not in extra and value is not None and not isinstance(value, str):
            raise MindSpeedError(f"--map-keys: {key!r} maps to a JSON {type(value).__name__}; give the name of the "
                                 f"record's column (a string)")
    return {**defaults, **{k: v for k, v in given.items() if k not in extra}}


def document_ids(tok, text: str, append_eod: bool) -> list[int]:
    """A document's tokens as Megatron's preprocess_data.py writes them: the end of document
    follows only a document that has tokens (an empty one stays empty and adds no sequence)."""
    ids = tok.encode(text)
    return ids + [tok.eod] if ids and append_eod else ids


class GeneralPretrainHandler:
    """Each --json-keys text a document of its own key (pre-training data). Its records are
    {key: text}, checked as they are read (preprocess.iter_records)."""

    instruction = False

    def __init__(self, tokenizer, template, options: dict):
        self.tok, self.append_eod = tokenizer, options["append_eod"]
        self.keys = tuple(options["json_keys"])

    def encode(self, record: dict, where: str) -> dict:
        return {key: document_ids(self.tok, record[key], self.append_eod) for key in self.keys}


class _Conversations:
    """Records made conversations (messages as data/chat_templates.py takes them)."""

    instruction = True
    style = ""  # "alpaca" or "sharegpt"
    pairwise = False
    prompt_only = False  # the reply is not read

    def __init__(self, tokenizer, template, options: dict):
        self.tok, self.template, self.append_eod = tokenizer, template, options["append_eod"]
        given = options.get("map_keys") or {}
        defaults = ALPACA_KEYS if self.style == "alpaca" else SHAREGPT_KEYS
        self.columns = _columns(given, defaults, self.style, ("tags",) if self.style == "sharegpt" else ())
        tags = given.get("tags") or {}
        if not isinstance(tags, dict) or set(tags) - set(SHAREGPT_TAGS) or \
                not all(isinstance(v, str) for v in tags.values()):
            raise MindSpeedError(f"--map-keys: tags takes an object of tag names (strings) for "
                                 f"{', '.join(SHAREGPT_TAGS)}")
        self.tags = {**SHAREGPT_TAGS, **tags}

    # -- records -> messages -------------------------------------------------------------------
    def _get(self, record: dict, column: str):
        return record.get(self.columns[column]) if self.columns[column] else None

    def _alpaca(self, record: dict, where: str) -> tuple[list[dict], list[str]]:
        """(the messages before the reply, the reply or the chosen and rejected ones)."""
        messages = []
        system = self._get(record, "system")
        if system:
            messages.append({"role": "system", "content": _text(system, where, "the system prompt")})
        history = self._get(record, "history") or []
        if not isinstance(history, list):
            raise MindSpeedError(f"{where}: the history must be a list of [instruction, response] pairs")
        for n, turn in enumerate(history):
            if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
                raise MindSpeedError(f"{where}: history turn {n} is not an [instruction, response] pair")
            messages += [{"role": "user", "content": _text(turn[0], where, f"history turn {n}'s instruction")},
                         {"role": "assistant", "content": _text(turn[1], where, f"history turn {n}'s response")}]
        prompt = _text(self._get(record, "prompt"), where, f"the instruction ({self.columns['prompt']!r})")
        query = self._get(record, "query")
        if query:
            prompt = prompt + "\n" + _text(query, where, f"the input ({self.columns['query']!r})")
        messages.append({"role": "user", "content": prompt})
        if self.pairwise:
            replies = [_text(self._get(record, c), where, f"the {c} reply ({self.columns[c]!r})")
                       for c in ("chosen", "rejected")]
        elif self.prompt_only:
            replies = []
        else:
            replies = [_text(self._get(record, "response"), where, f"the response ({self.columns['response']!r})")]
        return messages, replies

    def _sharegpt(self, record: dict, where: str) -> tuple[list[dict], list[str]]:
        t = self.tags
        turns = self._get(record, "messages")
        if not isinstance(turns, list) or not turns:
            raise MindSpeedError(f"{where}: {self.columns['messages']!r} must be a non-empty list of messages")

        def said(m, n):
            if not isinstance(m, dict):
                raise MindSpeedError(f"{where}: message {n} is not an object with {t['role_tag']!r} and "
                                     f"{t['content_tag']!r}")
            return m.get(t["role_tag"]), _text(m.get(t["content_tag"]), where, f"message {n}'s {t['content_tag']!r}")

        messages, first = [], 0  # first: where the turns start in the record (after a system message)
        role, content = said(turns[0], 0)
        system = self._get(record, "system")
        if role == t["system_tag"]:
            system, turns, first = content, turns[1:], 1
        if system:
            messages.append({"role": "system", "content": _text(system, where, "the system prompt")})
        if not turns:
            raise MindSpeedError(f"{where}: the conversation holds only a system message: no turn to train on")
        asks, answers = (t["user_tag"], t["observation_tag"]), (t["assistant_tag"], t["function_tag"])
        for n, m in enumerate(turns):
            role, content = said(m, first + n)
            wanted = answers if n % 2 else asks
            if role not in wanted:
                raise MindSpeedError(f"{where}: message {first + n} is from {role!r} where "
                                     f"{' or '.join(map(repr, wanted))} belongs (turns alternate, the user's first)")
            messages.append({"role": "assistant" if n % 2 else "user", "content": content})
        if self.pairwise:
            if len(turns) % 2 == 0:
                raise MindSpeedError(f"{where}: a pairwise conversation ends with the user's turn, the replies are "
                                     f"{self.columns['chosen']!r} and {self.columns['rejected']!r}")
            replies = []
            for c in ("chosen", "rejected"):
                reply = self._get(record, c)
                if isinstance(reply, dict):
                    role, content = said(reply, c)
                    if role not in answers:
                        raise MindSpeedError(f"{where}: the {c} reply is from {role!r}; a reply is the assistant's "
                                             f"({' or '.join(map(repr, answers))})")
                    replies.append(content)
                else:
                    replies.append(_text(reply, where, f"the {c} reply ({self.columns[c]!r})"))
            return messages, replies
        if len(turns) % 2:
            raise MindSpeedError(f"{where}: the conversation ends with the user's turn: nothing to train on")
        return messages[:-1], [messages[-1]["content"]]

    def conversation(self, record: dict, where: str) -> tuple[list[dict], list[str]]:
        if not isinstance(record, dict):
            raise MindSpeedError(f"{where} is a JSON {type(record).__name__}, not an object")
        return self._alpaca(record, where) if self.style == "alpaca" else self._sharegpt(record, where)

    def tokens(self, messages: list[dict], reply: str) -> tuple[list[int], list[int]]:
        """(input ids, labels) of a conversation ending with ``reply``."""
        ids, assistant = encode_conversation(self.tok, self.template,
                                             messages + [{"role": "assistant", "content": reply}])
        if getattr(self.template, "efficient_eos", False):  # the end of document after each reply is learnt
            return self.template.labels(ids, assistant, self.tok.eod, IGNORE)
        if self.append_eod and (not ids or ids[-1] != self.tok.eod):
            ids, assistant = ids + [self.tok.eod], assistant + [True]
        return ids, [i if a else IGNORE for i, a in zip(ids, assistant)]


class AlpacaStyleInstructionHandler(_Conversations):
    style = "alpaca"
    keys = ("input_ids", "attention_mask", "labels")

    def encode(self, record: dict, where: str) -> dict:
        messages, (reply,) = self.conversation(record, where)
        ids, labels = self.tokens(messages, reply)
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


class SharegptStyleInstructionHandler(AlpacaStyleInstructionHandler):
    style = "sharegpt"


class AlpacaStylePairwiseHandler(_Conversations):
    style = "alpaca"
    pairwise = True
    keys = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")

    def encode(self, record: dict, where: str) -> dict:
        messages, replies = self.conversation(record, where)
        if replies[0] == replies[1]:  # the preference losses would stay at their start, every gradient zero
            raise MindSpeedError(f"{where}: the chosen and the rejected reply are the same text: the pair teaches "
                                 "nothing; remove it from the data")
        out = {}
        for side, reply in zip(("chosen", "rejected"), replies):
            out[f"{side}_input_ids"], out[f"{side}_labels"] = self.tokens(messages, reply)
        return out


class SharegptStylePairwiseHandler(AlpacaStylePairwiseHandler):
    style = "sharegpt"


class PPOAlpacaStyleInstructionHandler(_Conversations):
    """Prompts alone, for online RL (MindSpeed-LLM's PPO data): the conversation before the
    reply (system, history, instruction and input), formatted up to where the assistant's
    turn begins; no labels, and the reply column, if any, unread. The history keeps its
    replies (MindSpeed-LLM's handler drops them, a model then reads a conversation with gaps)."""

    style = "alpaca"
    prompt_only = True
    keys = ("input_ids", "attention_mask")

    def encode(self, record: dict, where: str) -> dict:
        messages, _ = self.conversation(record, where)
        ids, _ = encode_conversation(self.tok, self.template, messages, add_generation_prompt=True)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}


class AlpacaStyleProcessRewardHandler:
    """A step-labelled solution (``input``, ``value``): MindSpeed-LLM's PRM data."""

    instruction = True
    keys = ("input_ids", "labels", "attention_mask")

    def __init__(self, tokenizer, template, options: dict):
        self.tok = tokenizer
        self.columns = _columns(options.get("map_keys") or {}, PRM_KEYS, "process-reward")
        self.placeholder = one_token(self.tok, options["placeholder_token"], "--placeholder-token")
        rewards = options.get("reward_tokens") or []
        self.rewards = {r: one_token(self.tok, r, "--reward-tokens") for r in rewards}

    def encode(self, record: dict, where: str) -> dict:
        if not isinstance(record, dict):
            raise MindSpeedError(f"{where} is a JSON {type(record).__name__}, not an object")
        ids = encode_plain(self.tok, _text(record.get(self.columns["input"]), where, repr(self.columns["input"])))
        values = record.get(self.columns["value"])
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise MindSpeedError(f"{where}: {self.columns['value']!r} must be a list of step labels")
        steps = [n for n, i in enumerate(ids) if i == self.placeholder]
        if not steps:
            raise MindSpeedError(f"{where}: no step ends with the placeholder token: a solution without labelled "
                                 "steps trains nothing")
        if len(steps) != len(values):
            raise MindSpeedError(f"{where}: {len(steps)} steps end with the placeholder token but {len(values)} "
                                 "labels are given")
        labels = [IGNORE] * len(ids)
        for n, value in zip(steps, values):
            if self.rewards and value not in self.rewards:
                raise MindSpeedError(f"{where}: label {value!r} is not one of --reward-tokens "
                                     f"{' '.join(self.rewards)}")
            labels[n] = self.rewards[value] if value in self.rewards else one_token(self.tok, value, "the step label",
                                                                                     where)
        return {"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)}


HANDLERS = {cls.__name__: cls for cls in (
    GeneralPretrainHandler, AlpacaStyleInstructionHandler, SharegptStyleInstructionHandler,
    AlpacaStylePairwiseHandler, SharegptStylePairwiseHandler, AlpacaStyleProcessRewardHandler,
    PPOAlpacaStyleInstructionHandler)}


def parse_map_keys(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise MindSpeedError(f"--map-keys is not JSON: {text[:60]!r}") from None
    if not isinstance(value, dict):
        raise MindSpeedError("--map-keys must be a JSON object, e.g. '{\"prompt\": \"question\"}'")
    return value
