"""The text sample at the end of a training run, and what the embedded default run says to do
next. The sample is drawn as the training documents were written: the prompt encoded with the
tokenizer's special tokens (BOS first where it adds one), ended where the model ends the
document; the embedded fine-tuning twin answers a question of its data in its chat template.
"""

from __future__ import annotations

import shlex

from mindspeed_core import nn
from mindspeed_core.data import chat_templates, corpus
from mindspeed_core.models.generate import Sampling, generate

TWIN_QUESTION = "What does json.dumps do?"


def draw(model, tokenizer, chat_twin: bool, tokens: int, window: int, seed: int) -> tuple:
    """(prompt, sampled ids, text, what to print) from the whole model on this process; no
    cache (it needs whole sequences), the last ``window`` tokens of a long sample seen."""
    prompt, encoded, stop = "def ", None, None
    if chat_twin:
        template = chat_templates.TEMPLATES[corpus.INSTRUCTION_TEMPLATE]
        prompt = TWIN_QUESTION
        encoded, _ = chat_templates.encode_conversation(tokenizer, template, [{"role": "user", "content": prompt}],
                                                        True)
        stop = template.stop[0]
    nn.set_training(model, False)
    ids = generate(model, [encoded or tokenizer.encode(prompt)], tokens,
                   Sampling(greedy=False, temperature=0.8, top_k=20, seed=seed),
                   stop_ids=(tokenizer.eod,), use_cache=False, window=window)[0]
    text = tokenizer.decode(ids)
    if stop is None:
        return prompt, ids, text, "sample:\n" + prompt + text
    text = text.split(stop)[0]
    return prompt, ids, text, f"sample:\nUser> {prompt}\nAssistant> {text}"


def next_steps(save: str, framework: str, fine_tuned: bool, source: str | None = None) -> str:
    """The commands that go on from the embedded default run's saved model; ``source``: the flags
    that give it (default --load SAVE; a LoRA run saved with --lora-ckpt-filter needs its base too)."""
    where = source or f"--load {shlex.quote(save)}"
    if fine_tuned:
        return (f"the fine-tuned model is saved in {save}; talk to it with\n"
                f"  mindspeed generate --ai-framework {framework} {where} --task chat --prompt-type "
                f"{corpus.INSTRUCTION_TEMPLATE}\n(it knows what the standard library's docstrings say: ask "
                f"'{TWIN_QUESTION}')")
    return (f"the model is saved in {save}; go on from it with\n"
            f"  mindspeed generate --ai-framework {framework} {where} --prompt 'def ' --stream\n"
            f"  mindspeed generate --ai-framework {framework} {where} --task chat\n"
            f"  mindspeed evaluate --ai-framework {framework} {where} --task perplexity --task-data-path "
            "FILE.txt")
