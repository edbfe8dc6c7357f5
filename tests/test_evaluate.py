"""`mindspeed evaluate` (mindspeed_core/evaluation): each task's reader on small hand-made
files in its standard layout, each scorer against models rigged to answer in known ways
(exact accuracy figures), perplexity against a hand count and against the model's logits,
and the command from a checkpoint."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from mindspeed_core import cli, nn, ops, random
from mindspeed_core.data.tokenizer import ByteTokenizer
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.evaluation import accuracy, scoring, tasks
from mindspeed_core.models.config import ModelConfig
from mindspeed_core.models.gpt import GPTModel
from scripted import ScriptedModel
from test_generate import checkpoint, wide_checkpoint, wide_moe_checkpoint  # noqa: F401  (fixtures)
from test_training import corpus  # noqa: F401  (a fixture)

# (question, A, B, C, D, answer) per subject
MMLU = {
    "astronomy": [("Closest star?", "Sun", "Vega", "Sirius", "Rigel", "A"),
                  ("Red planet?", "Venus", "Mars", "Earth", "Moon", "B"),
                  ("Ringed planet?", "Saturn", "Mercury", "Pluto", "Io", "A")],
    "high_school_math": [("2+2?", "3", "5", "4", "22", "C"), ("3*3?", "9", "6", "33", "0", "A"),
                         ("10/2?", "2", "8", "20", "5", "D"), ("1-1?", "0", "1", "2", "-1", "A")],
}


class Args:
    max_eval_samples, max_new_tokens, no_kv_cache = None, 40, True


def write_csv(path, rows, header=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        if header:
            w.writerow(header)
        w.writerows(rows)


def mmlu_folder(root):
    for subject, rows in MMLU.items():
        write_csv(root / "test" / f"{subject}_test.csv", rows)
        write_csv(root / "dev" / f"{subject}_dev.csv", [("Shot question?", "w", "x", "y", "z", "D")])
    return root


def scorer(answer, batch=2, positions=4096, every_position=False):
    return scoring.Scorer(ScriptedModel(answer, every_position), ByteTokenizer(), batch, positions)


def always(letter):  # after "Answer:" a space, then the letter
    return lambda text: letter if text.endswith(" ") else f" {letter}"


def knows(table):  # the right letter of the last question in the prompt
    def answer(text):
        question = text[:text.rindex("\nA. ")].split("\n")[-1]
        right = table[question]
        return right if text.endswith(" ") else f" {right}"
    return answer


@pytest.mark.feature("benchmark-evaluation")
def test_mmlu_prompts_and_exact_accuracy(tmp_path):
    subjects = tasks.read("mmlu", str(mmlu_folder(tmp_path / "data")), shot=1)
    assert list(subjects) == ["astronomy", "high_school_math"]
    assert subjects["astronomy"][1].prompt == (
        "The following are multiple choice questions (with answers) about astronomy.\n\n"
        "Shot question?\nA. w\nB. x\nC. y\nD. z\nAnswer: D\n\n"
        "Red planet?\nA. Venus\nB. Mars\nC. Earth\nD. Moon\nAnswer:")
    assert subjects["astronomy"][1].answer == " B"
    res = accuracy(scorer(always("A")), "mmlu", subjects, Args)
    assert res["subjects"]["astronomy"] == {"questions": 3, "correct": 2, "accuracy": 2 / 3}
    assert res["subjects"]["high_school_math"] == {"questions": 4, "correct": 2, "accuracy": 0.5}
    assert res["overall"] == {"questions": 7, "correct": 4, "accuracy": 4 / 7}
    table = {q: a for rows in MMLU.values() for q, *_, a in rows}
    assert accuracy(scorer(knows(table)), "mmlu", subjects, Args)["overall"]["correct"] == 7
    # the test folder itself may be given (dev/ beside it); zero shots need no dev split
    assert tasks.read("mmlu", str(tmp_path / "data" / "test"), shot=1) == subjects
    (tmp_path / "data" / "dev" / "astronomy_dev.csv").unlink()
    assert "Shot question" not in tasks.read("mmlu", str(tmp_path / "data"), shot=0)["astronomy"][0].prompt


@pytest.mark.feature("benchmark-evaluation")
def test_options_of_several_tokens_are_scored_whole(tmp_path):
    """Options that differ in more than their last token: each option's tokens are scored after
    the prompt (the rows padded on the right)."""
    subjects = {"s": [tasks.Item("Pick:", (" red", " blue", " green"), " blue"),
                      tasks.Item("Pick:", (" red", " blue", " green"), " red")]}

    def answer(text):  # says "blue", whatever it is asked
        if ":" not in text:
            return ""
        done = text[text.index(":") + 1:]
        return " blue"[len(done):] if " blue".startswith(done) else ""

    res = accuracy(scorer(answer, every_position=True), "boolq", subjects, Args)
    assert res["overall"] == {"questions": 2, "correct": 1, "accuracy": 0.5}


@pytest.mark.feature("benchmark-evaluation")
def test_ceval_reads_its_header_and_answers_without_a_space(tmp_path):
    header = ["id", "question", "A", "B", "C", "D", "answer", "explanation"]
    write_csv(tmp_path / "ceval" / "val" / "law_val.csv",
              [[0, "问题一", "甲", "乙", "丙", "丁", "B", ""], [1, "问题二", "甲", "乙", "丙", "丁", "C", ""]], header)
    write_csv(tmp_path / "ceval" / "dev" / "law_dev.csv", [[0, "例题", "甲", "乙", "丙", "丁", "A", "因为"]], header)
    subjects = tasks.read("ceval", str(tmp_path / "ceval"), shot=1)
    assert subjects["law"][0].prompt == ("以下是中国关于law考试的单项选择题，请选出其中的正确答案。\n\n"
                                         "例题\nA. 甲\nB. 乙\nC. 丙\nD. 丁\n答案：A\n\n问题一\nA. 甲\nB. 乙\nC. 丙\nD. 丁\n答案：")
    res = accuracy(scorer(lambda text: "B"), "ceval", subjects, Args)
    assert res["overall"] == {"questions": 2, "correct": 1, "accuracy": 0.5}


@pytest.mark.feature("benchmark-evaluation")
def test_gsm8k_takes_the_last_number_of_the_answer(tmp_path):
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    rows = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
            {"question": "What is 1,000 + 234?", "answer": "#### 1,234"},
            {"question": "What is 5 - 8?", "answer": "5-8=-3\n#### -3"}]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    subjects = tasks.read("gsm8k", str(folder), shot=1)
    items = subjects["test"]
    assert items[0].prompt == "Question: 1+1?\nAnswer: #### 2\n\nQuestion: Tom has 3 apples and buys 4. How many?\nAnswer:"
    assert [i.answer for i in items] == ["7", "1234", "-3"]
    replies = {"Tom": " 3 and 4 make 7.\n\nQuestion: 9?", "1,000": " It is 1,234.0", "5 - 8": " It is 3."}

    def answer(text):
        key = next(k for k in replies if k in text)
        done = text[text.index("Answer:", text.index(key)) + len("Answer:"):]
        return replies[key][len(done):]

    res = accuracy(scorer(answer, batch=2), "gsm8k", subjects, Args)
    assert res["overall"] == {"questions": 3, "correct": 2, "accuracy": 2 / 3}
    assert [tasks.number(x) for x in ("a 1,234 b 5", "x 3.0", "-7.", "none")] == ["5", "3", "-7", None]


@pytest.mark.feature("benchmark-evaluation")
def test_boolq_yes_or_no(tmp_path):
    rows = [{"question": "is the sky blue", "passage": "The sky is blue.", "answer": True},
            {"question": "is fire cold", "passage": "Fire is hot.", "answer": False},
            {"question": "is ice cold", "passage": "Ice is cold.", "answer": True}]
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = tasks.read("boolq", str(tmp_path), shot=0)["dev"]
    assert items[0].prompt == "The sky is blue.\nQuestion: is the sky blue?\nAnswer:"

    def says_yes(text):  # " no" and " yes" are several bytes: each is scored whole
        done = text[text.rindex("Answer:") + len("Answer:"):] if "Answer:" in text else None
        return " yes"[len(done):] if done is not None and " yes".startswith(done) else ""

    res = accuracy(scorer(says_yes, every_position=True), "boolq", {"dev": items}, Args)
    assert res["overall"] == {"questions": 3, "correct": 2, "accuracy": 2 / 3}
    superglue = tmp_path / "sg.jsonl"
    superglue.write_text(json.dumps({"question": "q", "passage": "p", "label": 0}) + "\n")
    assert tasks.read("boolq", str(superglue), 0)["sg"][0].answer == " no"


@pytest.mark.feature("perplexity")
def test_perplexity_by_hand_count(tmp_path):
    """The rigged model predicts a -> b -> c -> a: each right guess costs log(1 + 256 e^-10)
    nats, each wrong one log(e^10 + 256)."""
    text = "abcabcabxabcab"
    (tmp_path / "t.txt").write_text(text)
    tokens = tasks.texts(str(tmp_path / "t.txt"), ByteTokenizer())["t"]
    assert tokens == list(text.encode()) + [256]
    from mindspeed_core.data import indexed

    writer = indexed.IndexedDatasetWriter(str(tmp_path / "t_text_document"), np.uint16)
    writer.add_document(tokens)
    writer.finalize()
    assert tasks.texts(str(tmp_path / "t_text_document"), ByteTokenizer()) == {"t_text_document": tokens}
    follow = {"a": "b", "b": "c", "c": "a"}
    model = ScriptedModel(lambda t: follow.get(t[-1], ""), every_position=True)
    total, count = scoring.perplexity_sums(model, tokens, window=4, batch=3)
    right, wrong = math.log1p(256 * math.exp(-10)), math.log(math.exp(10) + 256)
    want, n = 0.0, 0
    for start in range(0, len(tokens) - 1, 3):
        piece = tokens[start:start + 4]
        for prev, nxt in zip(piece, piece[1:]):
            guess = follow.get(chr(prev))
            want += right if guess is not None and nxt == ord(guess) else wrong
            n += 1
    assert count == n == len(tokens) - 1 and total == pytest.approx(want, rel=1e-6)


@pytest.mark.feature("perplexity")
def test_perplexity_equals_the_models_own_log_probabilities():
    random.seed(2)
    model = GPTModel(ModelConfig(vocab_size=257, hidden_size=32, num_layers=2, num_attention_heads=4,
                                 num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=16,
                                 init_method_std=0.3))
    nn.set_training(model, False)
    tokens = list(np.random.default_rng(0).integers(0, 257, 53))
    total, count = scoring.perplexity_sums(model, tokens, window=16, batch=3)  # the last window is short
    want = 0.0
    for start in range(0, len(tokens) - 1, 15):  # each window begins with the last token of the one before
        piece = tokens[start:start + 16]
        logits = ops.to_numpy(ops.cast(model(ops.tensor(np.asarray([piece]))), "float32"))[0].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        want -= sum(logp[t, piece[t + 1]] for t in range(len(piece) - 1))
    assert count == 52 and total == pytest.approx(want, rel=1e-5)


@pytest.mark.feature("benchmark-evaluation")
@pytest.mark.framework_free
@pytest.mark.feature("evaluation-alternative-prompt")
def test_alternative_prompts_are_mindspeed_llms_wording(tmp_path):
    """--alternative-prompt: MMLU's questions open with the single-choice instruction, every dev
    question first whatever --shot says, the letter on the line after "Answer: " (so the options
    are a line break and a letter); BoolQ's name the title and offer A. Yes / B. No."""
    data = mmlu_folder(tmp_path / "data")
    write_csv(data / "dev" / "astronomy_dev.csv", [("Shot question?", "w", "x", "y", "z", "D"),
                                                   ("Second shot?", "p", "q", "r", "s", "B")])
    subjects = tasks.read("mmlu", str(data), shot=0, alternative=True)
    head = "There is a single choice question about {}. Answer the question by replying A, B, C or D. \nQuestion: "
    assert subjects["astronomy"][1].prompt == (
        head.format("astronomy") + "Shot question?\nA. w\nB. x\nC. y\nD. z\nAnswer: \nD\n\n"
        + head.format("astronomy") + "Second shot?\nA. p\nB. q\nC. r\nD. s\nAnswer: \nB\n\n"
        + head.format("astronomy") + "Red planet?\nA. Venus\nB. Mars\nC. Earth\nD. Moon\nAnswer: ")
    assert subjects["high_school_math"][0].prompt.startswith(head.format("high school math"))
    assert subjects["astronomy"][1].options == ("\nA", "\nB", "\nC", "\nD") and subjects["astronomy"][1].answer == "\nB"
    table = {q: a for rows in MMLU.values() for q, *_, a in rows}

    def knows_on_the_next_line(text):  # the letter after a line break, as the solved questions show
        if text.endswith("Answer: "):
            return "\n"
        if text.endswith("Answer: \n"):
            return table.get(text[:text.rindex("\nA. ")].split("Question: ")[-1], "")  # "" in the shots
        return ""

    res = accuracy(scorer(knows_on_the_next_line, every_position=True), "mmlu", subjects, Args)
    assert res["overall"] == {"questions": 7, "correct": 7, "accuracy": 1.0}
    # the standard prompt's options (" A" after "Answer:") are not what this model writes
    standard = tasks.read("mmlu", str(data), shot=1)
    assert accuracy(scorer(knows_on_the_next_line, every_position=True), "mmlu", standard, Args)["overall"]["correct"] < 7
    rows = [{"question": "is the sky blue", "passage": "The sky is blue.", "title": "Sky", "answer": True},
            {"question": "is fire cold", "passage": "Fire is hot.", "title": "Fire", "answer": False}]
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = tasks.read("boolq", str(tmp_path), shot=0, alternative=True)["dev"]
    assert items[1].prompt == "Fire -- Fire is hot.\nQuestion: is fire cold\nA. Yes\nB. No\nAnswer:"
    assert [i.answer for i in items] == [" A", " B"] and items[0].options == (" A", " B")
    with pytest.raises(MindSpeedError, match="built for mmlu and boolq, not ceval"):
        tasks.read("ceval", str(tmp_path), shot=0, alternative=True)


@pytest.mark.feature("evaluation-alternative-prompt")
def test_evaluate_with_the_alternative_prompt_from_a_checkpoint(capsys, checkpoint, tmp_path):  # noqa: F811
    """The flag as the upstream evaluate script passes it, through the command, on the model."""
    data = mmlu_folder(tmp_path / "data")
    out_file = tmp_path / "mmlu.json"
    assert cli.main(["evaluate", "--load", str(checkpoint), "--task", "mmlu", "--task-data-path", str(data),
                     "--alternative-prompt", "--results-file", str(out_file)]) == 0
    res = json.loads(out_file.read_text())
    assert res["alternative_prompt"] is True and res["overall"]["questions"] == 7


@pytest.mark.feature("perplexity")
def test_evaluate_command_from_a_checkpoint(capsys, checkpoint, tmp_path):  # noqa: F811
    rows = [{"question": f"is {n} even", "passage": f"{n} is a number.", "answer": n % 2 == 0} for n in range(5)]
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_file = tmp_path / "boolq.json"
    capsys.readouterr()
    assert cli.main(["evaluate", "--load", str(checkpoint), "--task", "boolq", "--task-data-path", str(tmp_path),
                     "--results-file", str(out_file), "--evaluation-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out_file.read_text())
    assert res["overall"]["questions"] == 5 and res["subjects"]["dev"]["questions"] == 5
    assert res["prompts_cut"] == 5  # 40-odd bytes each, 32 positions: each lost its beginning, and says so
    assert "overall" in out and "5 prompts were longer" in out
    (tmp_path / "text.txt").write_text("def add(a, b):\n    return a + b\n" * 4)
    # a --results-file in a folder yet to be made: made (probed before the evaluation, written after)
    assert cli.main(["evaluate", "--load", str(checkpoint), "--task", "perplexity", "--task-data-path",
                     str(tmp_path / "text.txt"), "--results-file", str(tmp_path / "new" / "ppl.json")]) == 0
    ppl = json.loads((tmp_path / "new" / "ppl.json").read_text())
    assert ppl["window"] == 32 and ppl["overall"]["tokens"] == 4 * 32  # 129 tokens, each but the first predicted
    assert ppl["overall"]["perplexity"] == pytest.approx(math.exp(ppl["overall"]["nll"]))
    assert 1 < ppl["overall"]["perplexity"] < 257


# layout -> (ranks, layout flags, checkpoint fixture, task)
PARALLEL_EVALUATION = {
    # each rank one layer and half its stage's vocabulary: the loss vocabulary-parallel on the
    # last stage, its logits reaching the first
    "tp2-pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], "wide_checkpoint",
                "perplexity"),
    # a mixture of experts with each rank half the experts, and two copies of that pair: each
    # copy scores every other question, the counts gathered once
    "ep2-dp2": (4, ["--expert-model-parallel-size", "2"], "wide_moe_checkpoint", "mmlu"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [
    pytest.param("tp2-pp2", marks=[pytest.mark.feature(i) for i in ("perplexity", "tensor-parallel",
                                                                      "pipeline-inference")]),
    pytest.param("ep2-dp2", marks=[pytest.mark.feature(i) for i in ("data-parallel-evaluation", "expert-parallel",
                                                                      "benchmark-evaluation")])])
def test_parallel_evaluation_scores_as_one_process(framework, capsys, request, tmp_path, layout):
    """`mindspeed launch -- evaluate` at MindSpeed-LLM's evaluate scripts' layouts: rank 0 alone
    writes the results, equal to one process's."""
    import os
    import subprocess
    import sys

    from launch import free_port

    ranks, flags, fixture, task = PARALLEL_EVALUATION[layout]
    if task == "perplexity":
        data = tmp_path / "text.txt"
        data.write_text("def add(a, b):\n    return a + b\n" * 4 + "class Foo:\n    pass\n")
    else:
        data = mmlu_folder(tmp_path / "mmlu")
    common = ["--load", str(request.getfixturevalue(fixture)), "--task", task, "--task-data-path", str(data),
              *(["--shot", "1"] if task == "mmlu" else [])]
    assert cli.main(["evaluate", *common, "--results-file", str(tmp_path / "one.json")]) == 0
    cmd = [sys.executable, "-m", "mindspeed_core.cli", "launch", "--nproc-per-node", str(ranks), "--master-port",
           str(free_port()), "--log-dir", str(tmp_path / "logs"), "--", "evaluate", "--ai-framework", framework,
           *common, "--results-file", str(tmp_path / "launched.json"), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    one, launched = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "launched"))
    if task == "perplexity":
        assert launched["overall"]["tokens"] == one["overall"]["tokens"] > 140
        # float32 sums over 148 tokens in another order: within 1e-6 of the nll (about 8)
        assert launched["overall"]["nll"] == pytest.approx(one["overall"]["nll"], rel=1e-6), (launched, one)
    else:  # every question counted once, and each scored as one process scores it
        assert launched["subjects"] == one["subjects"] and launched["overall"]["questions"] == 7, (launched, one)


@pytest.mark.parametrize("flags, message", [
    (["--task", "mmlu"], "--task mmlu needs --task-data-path"),
    (["--task", "greedy", "--task-data-path", "x"], "generation tasks run with 'mindspeed generate'"),
    (["--task", "mmlu", "--task-data-path", "/nonexistent"], "no such file or folder"),
    (["--task", "gsm8k", "--task-data-path", "{tmp}", "--max-new-tokens", "32"], "leaves no room"),
    (["--task", "mmlu", "--task-data-path", "{tmp}"], "no *_test.csv files"),
    (["--task", "boolq", "--task-data-path", "{tmp}/bad.jsonl"], "bad.jsonl:1: not JSON"),
])
def test_bad_evaluate_input_is_one_line(capsys, checkpoint, tmp_path, flags, message):  # noqa: F811
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    capsys.readouterr()
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert cli.main(["evaluate", "--load", str(checkpoint), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
