"""`mindspeed evaluate` (and tools/evaluation.py): score a trained model on a benchmark.

    mindspeed evaluate --load ckpt --task mmlu --task-data-path mmlu/data --shot 5

--task mmlu / ceval / boolq: the option the model finds most likely (log-likelihood of each
option's tokens after the prompt); gsm8k: the last number of its greedy answer; perplexity:
exp(mean negative log-likelihood) over the text read in windows of the model's positions
(--seq-length if smaller). Prints a table per subject (file) and overall (over all
questions), writes it as JSON (--results-file, default <task>_results.json), and shows a
progress bar on stderr. The model comes from --load or --load-hf as for `mindspeed
generate`; --prompt-type / --hf-chat-template wrap each prompt as a chat's user message
(instruction-tuned models).
"""

from __future__ import annotations

import json
import math
import os

from mindspeed_core import dist, features, files
from mindspeed_core.compat import megatron_args
from mindspeed_core.data import chat_templates
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.evaluation import scoring, tasks
from mindspeed_core.inference import load_model, set_aside_training_flags
from mindspeed_core.progress import Progress
from mindspeed_core.training import distributed

# where a generated answer ends (GSM8K's prompts put a blank line between examples)
ANSWER_STOPS = ("\n\n", "Question:")


def parser():
    p = megatron_args.training_parser("mindspeed evaluate", verb=True)
    p.description = "score a trained model on a benchmark"
    g = p.add_argument_group("evaluation")
    g.add_argument("--task-data-path", default=None, help="the task's data (see mindspeed_core/evaluation/tasks.py)")
    g.add_argument("--shot", type=megatron_args.COUNT, default=0, help="solved examples put before each question")
    g.add_argument("--evaluation-batch-size", type=megatron_args.POSITIVE_INT, default=8)
    g.add_argument("--max-eval-samples", type=megatron_args.POSITIVE_INT, default=None,
                   help="score only the first N questions of each subject")
    g.add_argument("--max-new-tokens", type=megatron_args.POSITIVE_INT, default=256,
                   help="the longest generated answer (gsm8k)")
    g.add_argument("--no-kv-cache", action="store_true", help="rerun the whole sequence at each generated token")
    g.add_argument("--results-file", default=None, help="where the results go as JSON (default <task>_results.json)")
    chat_templates.add_args(g, "default: none, the prompts as they are")
    return p


def run(args, backend) -> int:
    """`mindspeed evaluate` once its flags are parsed and the framework bound."""
    given = args.task or []
    if len(given) > 1:
        raise MindSpeedError(f"--task {' '.join(given)}: evaluate runs one task at a time")
    task = given[0] if given else None
    if task not in megatron_args.EVALUATION_TASKS:
        raise MindSpeedError(f"--task: choose one of {', '.join(megatron_args.EVALUATION_TASKS)}"
                             + (" (generation tasks run with 'mindspeed generate')" if task else ""))
    if not args.task_data_path:
        raise MindSpeedError(f"--task {task} needs --task-data-path")
    results_file = args.results_file or f"{task}_results.json"
    check_results_file(results_file)  # before the evaluation, not after it
    set_aside_training_flags(args, "evaluation")
    features.validate(args, backend.NAME, backend.device.type(), backend.FRAMEWORK_VERSION)
    # under a launcher (`mindspeed launch ... -- evaluate`) the ranks of one copy of the model
    # (its TP, PP and EP ranks) score the same questions, through the vocabulary-parallel loss
    # and gathered logits; the copies (data parallelism) each a share; rank 0 reports
    model, cfg, tokenizer, ps, tokenizer_path = load_model(args, replicas=True)
    share = Share(ps)
    speak = ps.rank == 0
    template = None
    if args.prompt_type or args.hf_chat_template:
        template = chat_templates.choose(args.prompt_type, args.hf_chat_template, tokenizer_path)
    positions = cfg.max_position_embeddings
    scorer = scoring.Scorer(model, tokenizer, args.evaluation_batch_size, positions, template)
    if task == "perplexity":
        window = min(positions, args.seq_length or positions)
        results = perplexity(model, tokenizer, args.task_data_path, window, args.evaluation_batch_size, speak, share)
    else:
        if task == "gsm8k" and args.max_new_tokens >= positions:
            raise MindSpeedError(f"--max-new-tokens {args.max_new_tokens} leaves no room for the question in the "
                                 f"model's {positions} positions")
        alternative = bool(getattr(args, "alternative_prompt", False))
        results = accuracy(scorer, task, tasks.read(task, args.task_data_path, args.shot, alternative), args, speak,
                           share)
        results.update(alternative_prompt=alternative)
    results.update(task=task, shot=args.shot, model=args.load or args.load_hf, prompts_cut=scorer.cut)
    if speak:
        print(table(results))
        if scorer.cut:
            print(f"note: {scorer.cut} prompts were longer than the model's {positions} positions and lost their "
                  "beginning")
        os.makedirs(os.path.dirname(os.path.abspath(results_file)), exist_ok=True)
        files.write_atomically(results_file, json.dumps(results, indent=2, ensure_ascii=False))
        print(f"results written to {results_file}")
    dist.shutdown()
    return 0


def check_results_file(path: str) -> None:
    """--results-file must be a file this process can write (its folder may still be created)."""
    if os.path.isdir(path):
        raise MindSpeedError(f"--results-file {path} is a folder: name the JSON file to write")
    files.check_writable(os.path.dirname(os.path.abspath(path)), f"--results-file {path}'s folder")


class Share:
    """This rank's share of an evaluation: the job holds ``copies`` copies of the model (the
    expert-data-parallel size: TP, PP and EP ranks make one copy), this rank's is the
    ``index``-th; each copy takes every copies-th question (or perplexity window), and the
    first rank of each copy reports its sums for ``total``."""

    def __init__(self, ps=None):
        self.ps = ps
        self.copies, self.index = (1, 0) if ps is None else (ps.size("edp"), ps.local_rank("edp"))
        if self.copies > 1:
            features.note_used("data-parallel-evaluation")

    def mine(self, items: list) -> list:
        return items[self.index::self.copies]

    def total(self, sums: dict) -> dict:
        """{name: [numbers]} summed over the copies (a collective of every rank)."""
        if self.ps is None or self.ps.world == 1:
            return sums
        c = self.ps.coords(self.ps.rank)
        first = c["tp"] == 0 and c["pp"] == 0 and self.ps.local_rank("ep") == 0
        out = {name: [0] * len(values) for name, values in sums.items()}
        for theirs in distributed.gather_json(sums if first else None, self.ps):
            for name, values in (theirs or {}).items():
                out[name] = [a + b for a, b in zip(out[name], values)]
        return out


def accuracy(scorer, task: str, subjects: dict, args, speak: bool = True, share: Share | None = None) -> dict:
    """Accuracy per subject and over all questions (``speak``: show the progress); ``share``:
    this copy's questions, the counts summed over the copies."""
    features.note_used("benchmark-evaluation")
    share = share or Share()
    if args.max_eval_samples:
        subjects = {name: items[:args.max_eval_samples] for name, items in subjects.items()}
    subjects = {name: share.mine(items) for name, items in subjects.items()}
    progress = Progress(sum(len(items) for items in subjects.values()), task, quiet=not speak)
    counts = {}
    for name, items in subjects.items():
        if task == "gsm8k":
            written = scorer.write([i.prompt for i in items], args.max_new_tokens, ANSWER_STOPS, not args.no_kv_cache)
            right = [tasks.number(text) == item.answer for text, item in zip(written, items)]
        else:
            right = [item.options[k] == item.answer for k, item in zip(scorer.pick(items), items)] if items else []
        counts[name] = [len(items), sum(right)]
        progress.update(len(items), postfix=name)
    rows = {name: {"questions": n, "correct": right, "accuracy": right / n if n else 0.0}
            for name, (n, right) in share.total(counts).items()}
    total = sum(r["questions"] for r in rows.values())
    correct = sum(r["correct"] for r in rows.values())
    return {"subjects": rows, "overall": {"questions": total, "correct": correct,
                                         "accuracy": correct / total if total else 0.0}}


def perplexity(model, tokenizer, path: str, window: int, batch: int, speak: bool = True,
               share: Share | None = None) -> dict:
    share = share or Share()
    texts = tasks.texts(path, tokenizer)
    for name, tokens in texts.items():
        if len(tokens) < 2:
            raise MindSpeedError(f"{name}: too short to measure (it needs 2 tokens or more)")
    progress = Progress(len(texts), "perplexity", quiet=not speak)
    sums = {}
    for name, tokens in texts.items():
        sums[name] = list(scoring.perplexity_sums(model, tokens, window, batch, share.mine))
        progress.update(1, postfix=name)
    rows, total, count = {}, 0.0, 0
    for name, (nll, n) in share.total(sums).items():
        rows[name] = {"tokens": n, "nll": nll / n, "perplexity": math.exp(nll / n)}
        total, count = total + nll, count + n
    return {"subjects": rows, "window": window,
            "overall": {"tokens": count, "nll": total / count, "perplexity": math.exp(total / count)}}


def table(results: dict) -> str:
    """The results as an aligned text table."""
    rows = list(results["subjects"].items()) + [("overall", results["overall"])]
    if results["task"] == "perplexity":
        head, cells = ("tokens", "nll", "perplexity"), [(r["tokens"], f"{r['nll']:.4f}", f"{r['perplexity']:.3f}")
                                                       for _, r in rows]
    else:
        head, cells = ("questions", "correct", "accuracy"), [(r["questions"], r["correct"], f"{r['accuracy']:.4f}")
                                                            for _, r in rows]
    width = max(len("subject"), *(len(name) for name, _ in rows))
    lines = [f"{'subject':<{width}}  " + "  ".join(f"{h:>10}" for h in head)]
    for (name, _), values in zip(rows, cells):
        lines.append(f"{name:<{width}}  " + "  ".join(f"{v:>10}" for v in values))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    return "\n".join(lines)
