"""Chat (`mindspeed generate --task chat`, mindspeed_core/chat.py) and conversation templates
(data/chat_templates.py): the built-in templates render what the equivalent Hugging Face
chat templates render in transformers, a template from tokenizer_config.json renders as
transformers renders it and cannot reach past the sandbox, the session keeps and cuts its
history, stops at a template's stop text, and /clear and /exit do what they say."""

from __future__ import annotations

import io
import json

import pytest

from mindspeed_core import cli, nn, random
from mindspeed_core.chat import Session, run
from mindspeed_core.data import chat_templates as ct
from mindspeed_core.data.tokenizer import ByteTokenizer, encode_plain
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.streaming import TextStream
from mindspeed_core.models import generate as gen
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import GPTModel
from scripted import ScriptedModel
from test_generate import checkpoint  # noqa: F401  (a fixture)
from test_training import corpus  # noqa: F401  (a fixture)

# The formats of Qwen2's and Llama 3's chat templates, written as jinja for this test.
QWEN_JINJA = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
              "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_JINJA = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Gemma's: no system role, a system message opens the first user turn
GEMMA_JINJA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
               "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
               "{% for m in rest %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
               "{{ (first if loop.first else '') + m['content'] }}<end_of_turn>\n{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name a prime.\nJust one."}],
]


def tokenizer_folder(path, template: str | None, bos: str = "<|endoftext|>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 3
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": bos}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name, jinja, bos", [("qwen", QWEN_JINJA, "<|endoftext|>"),
                                              ("llama3", LLAMA3_JINJA, "<|begin_of_text|>"),
                                              ("gemma", GEMMA_JINJA, "<bos>")])
@pytest.mark.framework_free
def test_templates_render_what_transformers_renders(tmp_path, name, jinja, bos):
    transformers = pytest.importorskip("transformers")
    folder = tokenizer_folder(tmp_path / "tok", jinja, bos)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = ct.hf_template(str(folder))
    from mindspeed_core.data.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(str(folder))
    for messages in CONVERSATIONS + [CONVERSATIONS[2][:2]]:
        generation = messages[-1]["role"] == "user"
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        assert ours.render(messages, generation) == want
        assert ct.TEMPLATES[name].render(messages, generation) == want  # the built-in one
        assert encode_plain(tokenizer, want) == hf.encode(want, add_special_tokens=False)
    # the assistant's pieces are the replies and what ends them
    pieces = ct.TEMPLATES[name].segments(CONVERSATIONS[2])
    assert [t for t, mine in pieces if mine] == [ct.TEMPLATES[name].assistant.format(content="Hello! How can I help?")]
    assert ct.TEMPLATES[name].stop[0] in pieces[-2][0]


@pytest.mark.framework_free
def test_alpaca_chatml_and_empty_layouts():
    talk = CONVERSATIONS[2]
    assert ct.TEMPLATES["empty"].render(talk) == "HiHello! How can I help?Name a prime.\nJust one."
    alpaca = ct.TEMPLATES["alpaca"].render(talk)
    assert alpaca.startswith("Below is an instruction that describes a task.")
    assert alpaca.endswith("### Instruction:\nHi\n\n### Response:\nHello! How can I help?\n\n"
                           "### Instruction:\nName a prime.\nJust one.\n\n### Response:\n")
    assert ct.TEMPLATES["chatml"].render(talk[:1]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(MindSpeedError, match="a system message may only come first"):
        ct.TEMPLATES["chatml"].render([*talk, {"role": "system", "content": "late"}])
    with pytest.raises(MindSpeedError, match="message 0 must be"):
        ct.TEMPLATES["chatml"].render([{"role": "robot", "content": "x"}])


@pytest.mark.parametrize("template, message", [
    ("{{ messages.__class__.__mro__ }}", "__class__"),
    ("{% set x = messages.append({'role': 'user', 'content': 'again'}) %}{{ messages }}", "append"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
])
@pytest.mark.framework_free
def test_a_chat_template_runs_in_the_sandbox(tmp_path, template, message):
    pytest.importorskip("jinja2")
    folder = tokenizer_folder(tmp_path / "tok", template)
    with pytest.raises(MindSpeedError, match=message):
        ct.hf_template(str(folder)).render(CONVERSATIONS[0])


@pytest.mark.framework_free
def test_the_template_is_chosen_as_the_flags_say(tmp_path):
    pytest.importorskip("jinja2")
    with_template = tokenizer_folder(tmp_path / "with", QWEN_JINJA)
    without = tokenizer_folder(tmp_path / "without", None)
    assert isinstance(ct.choose(None, False, str(with_template)), ct.HFTemplate)
    assert ct.choose(None, True, str(with_template)).render(CONVERSATIONS[0]).startswith("<|im_start|>system")
    assert ct.choose("alpaca", False, str(with_template)) is ct.TEMPLATES["alpaca"]
    assert ct.choose(None, False, str(without)) is ct.TEMPLATES["empty"]
    (with_template / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")  # transformers 5 writes one
    assert ct.choose(None, False, str(with_template)).render(CONVERSATIONS[0]) == "What is 2+2?!"
    for args, message in [(("qwen", True, str(with_template)), "not both"),
                          (("nope", False, None), "unknown --prompt-type 'nope'"),
                          ((None, True, str(without)), "has no chat template")]:
        with pytest.raises(MindSpeedError, match=message):
            ct.choose(*args)


def test_a_stop_text_ends_the_reply_and_is_never_printed(capsys):
    stream = TextStream(ByteTokenizer(), True, ("<|im_end|>",))
    printed = []
    for byte in "Hi <|im".encode():
        assert not stream.step([byte])
        printed.append(capsys.readouterr().out)
    assert "".join(printed) == "Hi "  # "<|im" may begin the stop text: held back
    assert not stream.step([ord("x")])
    assert capsys.readouterr().out == "<|imx"  # it did not
    ended = [stream.step([b]) for b in "<|im_end|>more".encode()]
    assert ended.index(True) == len("<|im_end|>") - 1
    assert stream.close() == "Hi <|imx" and capsys.readouterr().out == "\n"


@pytest.mark.feature("chat")
def test_the_session_reads_the_rendered_history_and_stops_at_the_stop_text():
    replies = iter(["Four.", "Seven!"])
    script = {}

    def answer(text):  # after each request for a reply: the next reply, its stop text, then chatter
        head = text[:text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")]
        if head not in script:
            script[head] = next(replies) + "<|im_end|>and more"
        return script[head][len(text) - len(head):]

    model = ScriptedModel(answer)
    template = ct.TEMPLATES["chatml"]
    session = Session(model, ModelConfig(vocab_size=257, hidden_size=8, num_layers=1, num_attention_heads=1,
                                         max_position_embeddings=512),
                      ByteTokenizer(), template, gen.Sampling(), 40, history_turns=3, system="Be brief.",
                      use_cache=False)
    assert session.reply("What is 2+2?") == "Four."
    assert session.reply("And 3+4?") == "Seven!"
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
               {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And 3+4?"}]
    assert model.seen[len("Four.<|im_end|>")] == template.render(history)  # the second reply's first step
    assert len(model.seen) == len("Four.<|im_end|>") + len("Seven!<|im_end|>")  # each stopped at its stop text


@pytest.mark.feature("chat")
@pytest.mark.feature("kv-cache")
def test_history_is_kept_cut_and_cleared():
    random.seed(5)
    cfg = ModelConfig(vocab_size=257, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64, max_position_embeddings=128, init_method_std=0.3)
    model = GPTModel(cfg)
    nn.set_training(model, False)
    tok, template = ByteTokenizer(), ct.TEMPLATES["alpaca"]

    def alone(messages):  # the greedy reply to this exact conversation (a reply of it ends with the end of document)
        prompt, _ = ct.encode_conversation(tok, template, messages, add_generation_prompt=True)
        ids = gen.generate(model, [prompt], 6, stop_ids=(tok.eod,))[0]
        return tok.decode(ids)

    session = Session(model, cfg, tok, template, gen.Sampling(), 6, history_turns=1, system="")
    first = session.reply("2+2?")
    assert first == alone([{"role": "system", "content": ""}, {"role": "user", "content": "2+2?"}])
    second = session.reply("3+4?")
    assert second == alone([{"role": "system", "content": ""}, {"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": first}, {"role": "user", "content": "3+4?"}])
    third = session.reply("5+6?")  # one round of history: "2+2?" is gone
    assert third == alone([{"role": "system", "content": ""}, {"role": "user", "content": "3+4?"},
                           {"role": "assistant", "content": second}, {"role": "user", "content": "5+6?"}])
    # a long round no longer fits the 128 positions with the next one: it is left out
    session.rounds = [("x" * 40, "y" * 30)]
    assert session.prompt("5+6?") == encode_plain(tok, template.render([
        {"role": "system", "content": ""}, {"role": "user", "content": "5+6?"}]))
    with pytest.raises(MindSpeedError, match="this message does not fit"):
        session.prompt("z" * 120)
    session.clear()
    assert session.reply("2+2?") == first


@pytest.mark.feature("chat")
def test_chat_command_reads_messages_until_exit(capsys, monkeypatch, checkpoint):  # noqa: F811
    argv = ["generate", "--load", str(checkpoint), "--task", "chat", "--max-new-tokens", "5", "--prompt-type",
            "empty", "--history-turns", "1"]
    monkeypatch.setattr("sys.stdin", io.StringIO("def \n/clear\ndef \nclass\n/exit\nnever read\n"))
    capsys.readouterr()
    assert cli.main([*argv, "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [r["user"] for r in rows] == ["def ", "def ", "class"]
    assert rows[0]["reply"] == rows[1]["reply"]  # /clear: the same question gets the same answer
    monkeypatch.setattr("sys.stdin", io.StringIO("def \n/clear\n"))  # the end of input ends it too
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"Assistant> {rows[0]['reply']}\n" in out and "(history cleared)" in out
    # MindSpeed-LLM's words: clear and new forget, q, exit and quit end
    for forget, stop in (("clear", "q"), (" new", "exit"), ("new", "quit")):
        monkeypatch.setattr("sys.stdin", io.StringIO(f"def \n{forget}\ndef \nclass\n{stop}\nnever read\n"))
        assert cli.main([*argv, "--json"]) == 0
        got = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
        assert got == rows, (stop, got)


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "x"], "reads its messages from the terminal"),
    (["--prompt-type", "nope"], "unknown --prompt-type"),
    (["--tensor-model-parallel-size", "2"], "runs in one process"),
])
def test_bad_chat_flags_are_one_line(capsys, checkpoint, flags, message):  # noqa: F811
    capsys.readouterr()
    assert cli.main(["generate", "--load", str(checkpoint), "--task", "chat", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_run_skips_blank_lines_and_goes_on_after_a_message_too_long(capsys):
    session = Session(ScriptedModel(lambda text: "ok"[len(text) - text.rindex("?") - 1:] if "?" in text else ""),
                      ModelConfig(vocab_size=257, hidden_size=8, num_layers=1, num_attention_heads=1,
                                  max_position_embeddings=16),
                      ByteTokenizer(), ct.TEMPLATES["empty"], gen.Sampling(), 4, history_turns=0, use_cache=False)
    run(session, speak=True, as_json=True, lines=io.StringIO("\n" + "w" * 20 + "\nfine?\n"))
    out, err = capsys.readouterr()
    assert "this message does not fit" in err
    assert [json.loads(x) for x in out.splitlines()] == [{"user": "fine?", "reply": "ok"}]


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(capsys):
    """The terminal's bytes: a message that is not UTF-8 gets one error line, the next one a reply."""
    session = Session(ScriptedModel(lambda text: "ok"[len(text) - text.rindex("?") - 1:] if "?" in text else ""),
                      ModelConfig(vocab_size=257, hidden_size=8, num_layers=1, num_attention_heads=1,
                                  max_position_embeddings=16),
                      ByteTokenizer(), ct.TEMPLATES["empty"], gen.Sampling(), 4, history_turns=0, use_cache=False)
    run(session, speak=True, as_json=True, lines=io.BytesIO(b"caf\xe9?\nfine?\n/exit\n"))
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "not UTF-8 text (byte 0xe9)" in err, err
    assert [json.loads(x) for x in out.splitlines()] == [{"user": "fine?", "reply": "ok"}]


def test_glm4_moe_learns_each_reply_end_where_the_next_turn_starts():
    """MindSpeed-LLM's glm4_moe template (efficient_eos): the text runs from one turn's marker to
    the next with no end of document between them; fine-tuning's label at the first token after
    each reply is the end of document, and the last reply gets it appended."""
    glm = ct.TEMPLATES["glm4_moe"]
    talk = [{"role": "system", "content": "Be brief."}, *CONVERSATIONS[2], {"role": "assistant", "content": "7"}]
    assert glm.render(talk) == ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\nHello! How can I help?"
                                "<|user|>\nName a prime.\nJust one.<|assistant|>\n7")
    assert glm.render(talk[:2]) == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>"
    tok = ByteTokenizer()
    ids, mine = ct.encode_conversation(tok, glm, talk)
    assert tok.eod not in ids
    ids, labels = glm.labels(ids, mine, tok.eod, -100)
    assert ids[-1] == tok.eod and labels[-1] == tok.eod
    first_reply_end = next(j for j in range(1, len(mine)) if mine[j - 1] and not mine[j])
    assert labels[first_reply_end] == tok.eod and ids[first_reply_end] == encode_plain(tok, "<|user|>")[0]
    learnt = [lab for lab in labels if lab != -100]
    assert tok.decode([t for t in learnt if t != tok.eod]) == "\nHello! How can I help?\n7"
    assert learnt.count(tok.eod) == 2


def test_cpm_writes_the_tokenizers_beginning_of_sequence_then_its_markers():
    """MindSpeed-LLM's cpm template (its Seed-OSS fine-tuning lines): the tokenizer's own
    beginning-of-sequence token (by id, whatever its text), "<用户>" before each user message and
    "<AI>" after it, each reply ended by the end of document."""
    cpm = ct.TEMPLATES["cpm"]
    talk = [*CONVERSATIONS[2], {"role": "assistant", "content": "7"}]
    assert cpm.render(talk) == "<用户>Hi<AI>Hello! How can I help?<用户>Name a prime.\nJust one.<AI>7"
    tok = ByteTokenizer()
    tok.bos = 65
    ids, mine = ct.encode_conversation(tok, cpm, talk)
    assert ids[0] == 65 and not mine[0] and ids.count(tok.eod) == 2
    assert tok.decode([t for t, m in zip(ids, mine) if m and t != tok.eod]) == "Hello! How can I help?7"
    assert ct.encode_conversation(ByteTokenizer(), cpm, talk)[0] == ids[1:]  # a tokenizer without one: none
