"""The evaluation sets, read from their usual local layouts into prompts with known answers.

- mmlu: Hendrycks' csv files without a header (question, A, B, C, D, answer), one per subject:
  ``DIR/test/<subject>_test.csv`` with shots from ``DIR/dev/<subject>_dev.csv`` (DIR may also be
  the test folder itself, with dev/ beside it);
- ceval: csv files with a header (id, question, A, B, C, D, answer[, explanation]):
  ``DIR/val/<subject>_val.csv``, shots from ``DIR/dev/<subject>_dev.csv`` (the test split has
  no answers);
- gsm8k: jsonl lines {"question", "answer"} whose answer ends "#### <number>": ``test.jsonl``
  (or the file given), shots from ``train.jsonl`` beside it;
- boolq: jsonl lines {"question", "passage", "answer": true|false} (or SuperGLUE's "label" 1|0):
  ``dev.jsonl``/``val.jsonl``/``validation.jsonl`` (or the file given), shots from
  ``train.jsonl``;
- perplexity: text (a .txt file, a folder of them, or .jsonl lines with "text") or our
  indexed data (the prefix of a .bin/.idx pair).

--alternative-prompt words MMLU's and BoolQ's prompts as MindSpeed-LLM's evaluation does with
that flag (ALTERNATIVE); the answer is still the option the model finds most likely.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import re
from dataclasses import dataclass

from mindspeed_core import features
from mindspeed_core.files import read_text
from mindspeed_core.data import indexed
from mindspeed_core.errors import MindSpeedError

LETTERS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class Item:
    """One question: the ``prompt`` the model continues and its right ``answer``: one of the
    ``options`` (continuations scored against each other), or, when there are none, the
    number the generated text must end with."""

    prompt: str
    options: tuple[str, ...]
    answer: str


def read(task: str, path: str, shot: int, alternative: bool = False) -> dict[str, list[Item]]:
    """{subject: items} of a multiple-choice or question-answering task; ``alternative``: in
    MindSpeed-LLM's other wording (--alternative-prompt)."""
    if not os.path.exists(path):
        raise MindSpeedError(f"--task-data-path {path}: no such file or folder")
    if alternative:
        features.note_used("evaluation-alternative-prompt")
        if task not in ALTERNATIVE:
            raise MindSpeedError(f"--alternative-prompt is built for {' and '.join(ALTERNATIVE)}, not {task} "
                                 f"(leave the flag out for the task's standard prompt)")
        return ALTERNATIVE[task](path, shot)
    return {"mmlu": _mmlu, "ceval": _ceval, "gsm8k": _gsm8k, "boolq": _boolq}[task](path, shot)


def _split_files(path: str, split: str, suffix: str) -> tuple[list[str], str]:
    """The <subject>_<split><suffix> files and the folder of their dev shots."""
    folder = os.path.join(path, split) if os.path.isdir(os.path.join(path, split)) else path
    files = sorted(glob.glob(os.path.join(folder, f"*_{split}{suffix}")))
    if not files:
        raise MindSpeedError(f"--task-data-path {path}: no *_{split}{suffix} files (in it or in its {split}/ folder)")
    return files, os.path.join(os.path.dirname(os.path.abspath(folder)), "dev")


def _shots(dev_dir: str, subject: str, suffix: str, shot: int, read_rows) -> list:
    if shot == 0:
        return []
    file = os.path.join(dev_dir, f"{subject}_dev{suffix}")
    if not os.path.isfile(file):
        raise MindSpeedError(f"--shot {shot} needs the dev split: no {file}")
    rows = read_rows(file)
    if len(rows) < shot:
        raise MindSpeedError(f"--shot {shot}: {file} has {len(rows)} questions only")
    return rows[:shot]


def _choice(question: str, options, cue: str, answer: str | None = None) -> str:
    """A multiple-choice question as the prompt writes it; with its answer (a shot) or
    ending at the cue the model answers after."""
    text = question + "".join(f"\n{letter}. {option}" for letter, option in zip(LETTERS, options)) + f"\n{cue}"
    if answer is None:
        return text
    return text + (" " if cue.endswith(":") else "") + answer + "\n\n"


def _check_answer(answer: str, file: str, line: int) -> str:
    answer = answer.strip()
    if answer not in LETTERS:
        raise MindSpeedError(f"{file}:{line}: the answer must be one of {', '.join(LETTERS)}, got {answer!r}")
    return answer


def _mmlu_rows(file: str) -> list[tuple]:
    rows = []
    with io.StringIO(read_text(file), newline="") as fh:
        for line, row in enumerate(csv.reader(fh), 1):
            if len(row) != 6:
                raise MindSpeedError(f"{file}:{line}: an MMLU row has 6 columns (question, A, B, C, D, answer), "
                                     f"this one {len(row)}")
            rows.append((row[0], row[1:5], _check_answer(row[5], file, line)))
    return rows


def _subject_files(path: str, shot: int, split: str, read_rows, head, cue: str, space: str) -> dict[str, list[Item]]:
    """MMLU and CEval share a layout: <subject>_<split>.csv files, the k shots from the matching dev
    file, and a letter answer; they differ in the header, the answer cue and whether a letter
    is a token of its own after a space (MMLU's " A") or follows the cue directly (CEval)."""
    files, dev = _split_files(path, split, ".csv")
    out = {}
    for file in files:
        subject = os.path.basename(file)[:-len(f"_{split}.csv")]
        shots = "".join(_choice(q, o, cue, a) for q, o, a in _shots(dev, subject, ".csv", shot, read_rows))
        rows = read_rows(file)
        if not rows:
            raise MindSpeedError(f"{file} holds no questions")
        out[subject] = [Item(head(subject) + shots + _choice(q, o, cue), tuple(space + x for x in LETTERS), space + a)
                        for q, o, a in rows]
    return out


def _mmlu(path: str, shot: int) -> dict[str, list[Item]]:
    return _subject_files(path, shot, "test", _mmlu_rows, lambda subject: "The following are multiple choice "
                          f"questions (with answers) about {subject.replace('_', ' ')}.\n\n", "Answer:", " ")


def _mmlu_alternative(path: str, shot: int) -> dict[str, list[Item]]:
    """MindSpeed-LLM's other MMLU wording: each question, the dev split's solved ones first (all
    of them, whatever --shot says, as upstream), opens with a single-choice instruction and ends
    at "Answer: "; a solved one's letter follows on the next line, so the options are scored
    as a line break and a letter."""
    files, dev = _split_files(path, "test", ".csv")
    out = {}
    for file in files:
        subject = os.path.basename(file)[:-len("_test.csv")]
        head = (f"There is a single choice question about {subject.replace('_', ' ')}. Answer the question by "
                f"replying A, B, C or D. \nQuestion: ")
        shots_file = os.path.join(dev, f"{subject}_dev.csv")
        if not os.path.isfile(shots_file):
            raise MindSpeedError(f"--alternative-prompt puts the dev split's questions first: no {shots_file}")
        shots = "".join(head + _choice(q, o, "Answer: ") + f"\n{a}\n\n" for q, o, a in _mmlu_rows(shots_file))
        rows = _mmlu_rows(file)
        if not rows:
            raise MindSpeedError(f"{file} holds no questions")
        out[subject] = [Item(shots + head + _choice(q, o, "Answer: "), tuple(f"\n{x}" for x in LETTERS), f"\n{a}")
                        for q, o, a in rows]
    return out


def _ceval_rows(file: str) -> list[tuple]:
    with io.StringIO(read_text(file), newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"question", *LETTERS, "answer"} - set(reader.fieldnames or ())
        if missing:
            raise MindSpeedError(f"{file}: a CEval file needs the columns question, A, B, C, D, answer; missing "
                                 f"{', '.join(sorted(missing))}")
        return [(row["question"], [row[x] for x in LETTERS], _check_answer(row["answer"] or "", file, line))
                for line, row in enumerate(reader, 2)]


def _ceval(path: str, shot: int) -> dict[str, list[Item]]:
    return _subject_files(path, shot, "val", _ceval_rows,
                          lambda subject: f"以下是中国关于{subject}考试的单项选择题，请选出其中的正确答案。\n\n", "答案：", "")


def _jsonl(file: str, keys: tuple[str, ...]) -> list[dict]:
    rows = []
    for line, text in enumerate(read_text(file).splitlines(), 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError as exc:
            raise MindSpeedError(f"{file}:{line}: not JSON ({getattr(exc, 'msg', exc)})") from None
        missing = [k for k in keys if k not in row] if isinstance(row, dict) else list(keys)
        if missing:
            raise MindSpeedError(f"{file}:{line}: needs the keys {', '.join(keys)}; missing {', '.join(missing)}")
        for key in keys:  # the listed keys are texts a prompt is made of
            if not isinstance(row[key], str):
                raise MindSpeedError(f"{file}:{line}: {key!r} is a JSON {type(row[key]).__name__}, not text")
            try:
                row[key].encode("utf-8")
            except UnicodeEncodeError:
                raise MindSpeedError(f"{file}:{line}: {key!r} holds a lone surrogate, not text") from None
        rows.append(row)
    return rows


def _data_file(path: str, names: tuple[str, ...]) -> str:
    if os.path.isfile(path):
        return path
    for name in names:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise MindSpeedError(f"--task-data-path {path}: no {' or '.join(names)} in it")


def _train_shots(file: str, shot: int, keys) -> list[dict]:
    if shot == 0:
        return []
    train = os.path.join(os.path.dirname(os.path.abspath(file)), "train.jsonl")
    if not os.path.isfile(train):
        raise MindSpeedError(f"--shot {shot} needs examples: no {train}")
    rows = _jsonl(train, keys)
    if len(rows) < shot:
        raise MindSpeedError(f"--shot {shot}: {train} has {len(rows)} examples only")
    return rows[:shot]


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def number(text: str) -> str | None:
    """The last number written in ``text``, without thousands separators or a trailing .0."""
    found = NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def _gsm8k(path: str, shot: int) -> dict[str, list[Item]]:
    file = _data_file(path, ("test.jsonl",))
    keys = ("question", "answer")
    shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in _train_shots(file, shot, keys))
    items = []
    for line, row in enumerate(_jsonl(file, keys), 1):
        if "####" not in row["answer"] or number(row["answer"].split("####")[-1]) is None:
            raise MindSpeedError(f"{file}: example {line}'s answer does not end with '#### <number>'")
        items.append(Item(f"{shots}Question: {row['question']}\nAnswer:", (),
                          number(row["answer"].split("####")[-1])))
    return {os.path.splitext(os.path.basename(file))[0]: items}


def _yes(row: dict, file: str) -> bool:
    value = row.get("answer", row.get("label"))
    if value not in (True, False, 0, 1):
        raise MindSpeedError(f"{file}: a BoolQ answer is true/false (or label 1/0), got {value!r}")
    return bool(value)


def _boolq(path: str, shot: int) -> dict[str, list[Item]]:
    file = _data_file(path, ("dev.jsonl", "val.jsonl", "validation.jsonl"))
    keys = ("question", "passage")

    def ask(r):
        return f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:"

    shots = "".join(f"{ask(r)} {'yes' if _yes(r, file) else 'no'}\n\n" for r in _train_shots(file, shot, keys))
    items = [Item(shots + ask(r), (" no", " yes"), " yes" if _yes(r, file) else " no") for r in _jsonl(file, keys)]
    return {os.path.splitext(os.path.basename(file))[0]: items}


def _boolq_alternative(path: str, shot: int) -> dict[str, list[Item]]:
    """MindSpeed-LLM's other BoolQ wording: the passage under its title, and the question with
    the options A. Yes and B. No (its rows need a "title")."""
    file = _data_file(path, ("dev.jsonl", "val.jsonl", "validation.jsonl"))
    keys = ("question", "passage", "title")

    def ask(r):
        return f"{r['title']} -- {r['passage']}\nQuestion: {r['question']}\nA. Yes\nB. No\nAnswer:"

    shots = "".join(f"{ask(r)} {'A' if _yes(r, file) else 'B'}\n\n" for r in _train_shots(file, shot, keys))
    items = [Item(shots + ask(r), (" A", " B"), " A" if _yes(r, file) else " B") for r in _jsonl(file, keys)]
    return {os.path.splitext(os.path.basename(file))[0]: items}


ALTERNATIVE = {"mmlu": _mmlu_alternative, "boolq": _boolq_alternative}


def texts(path: str, tokenizer) -> dict[str, list[int]]:
    """{name: tokens} for perplexity: each document's tokens, documents joined by the end of
    document token as in pre-training."""
    if os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx"):
        return {os.path.basename(path): indexed.IndexedDataset(path).tokens().astype(int).tolist()}
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.txt")) + glob.glob(os.path.join(path, "*.jsonl")))
        if not files:
            raise MindSpeedError(f"--task-data-path {path}: no .txt or .jsonl files, and no {path}.bin/.idx")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise MindSpeedError(f"--task-data-path {path}: no such file or folder, and no {path}.bin/.idx")
    out = {}
    eod = getattr(tokenizer, "eod", None)
    for file in files:
        if file.endswith(".jsonl"):
            documents = [r["text"] for r in _jsonl(file, ("text",))]
        else:
            documents = [read_text(file)]
        tokens = []
        for doc in documents:
            tokens += tokenizer.encode(doc) + ([eod] if eod is not None else [])
        out[os.path.splitext(os.path.basename(file))[0]] = tokens
    return out
