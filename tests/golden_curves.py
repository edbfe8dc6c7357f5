"""Golden curves, as Megatron's functional tests keep them: the loss, the gradient norm and the
count of skipped steps at every step of the first 6 steps of a 20-step run (its learning-rate
schedule; --exit-interval stops it early, which costs less time and changes no value) of
six canonical configurations, per framework, in tests/golden/<framework>.json. The layout tests compare two paths of the same
code; these compare the code with what it did when the file was written, so a change that
moves both paths (initialisation, data order, loss scaling, the tokenizer) shows.

    python tests/golden_curves.py --ai-framework pytorch     # rewrite tests/golden/pytorch.json
    python tests/golden_curves.py --ai-framework mindspore

Regenerate only for a change meant to move the curves, and review the file's diff like code.
The data is made here from a seeded generator (sums written out), except the embedded default's,
which is its own (the Python standard library's text of this interpreter): the values hold for
this host's Python, torch and MindSpore releases.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import pathlib
import random
import sys

HERE = pathlib.Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
STEPS = 20  # the schedule's length (--train-iters)
RUN_STEPS = 6  # the steps run and compared (--exit-interval, not part of a configuration's flags)
LOSS_TOL = 1e-5  # relative, every step
NORM_TOL = 1e-4  # relative, every step (Adam amplifies ulp-sized differences into later norms)

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--lr-decay-iters", str(STEPS),
         "--eval-iters", "0", "--log-interval", "1", "--make-vocab-size-divisible-by", "8", "--no-progress",
         "--seed", "11", "--sample-tokens", "0", "--tokenizer-type", "ByteLevel", "--train-iters", str(STEPS)]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--moe-aux-loss-coeff", "0.01",
       "--first-k-dense-replace", "1"]
# name -> (ranks, data, flags); "default" is `mindspeed train` itself, only made to log each step
CONFIGS = {
    "default": (1, None, ["--train-iters", str(STEPS), "--log-interval", "1", "--no-progress", "--sample-tokens", "0"]),
    "sft": (1, "sft", [*MODEL, "--stage", "sft"]),
    "tp2-sp-distopt": (2, "text", [*MODEL, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--use-distributed-optimizer"]),
    "pp2-vpp": (2, "text", [*MODEL, "--pipeline-model-parallel-size", "2",
                            "--num-layers-per-virtual-pipeline-stage", "1"]),
    "cp2": (2, "text", [*MODEL, "--context-parallel-size", "2"]),
    "moe-ep2": (2, "text", [*MODEL, *MOE, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                            "alltoall"]),
}


def make_data(root: pathlib.Path) -> dict:
    """{"text": pre-training prefix, "sft": instruction prefix}: sums of two numbers, from a
    seeded generator (Random's integers are the same on every Python since 3.2)."""
    from mindspeed_core import cli

    rng = random.Random(20)
    sums = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(3000)]
    with open(root / "sums.jsonl", "w") as fh:
        for k in range(0, 3000, 10):
            fh.write(json.dumps({"text": " ".join(f"{a}+{b}={a + b}." for a, b in sums[k:k + 10])}) + "\n")
    with open(root / "asks.jsonl", "w") as fh:
        for a, b in sums[:600]:
            fh.write(json.dumps({"instruction": f"{a}+{b}", "output": str(a + b)}) + "\n")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["preprocess", "--input", str(root / "sums.jsonl"), "--output-prefix", str(root / "sums"),
                         "--append-eod"]) == 0
        assert cli.main(["preprocess", "--input", str(root / "asks.jsonl"), "--output-prefix", str(root / "asks"),
                         "--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "empty",
                         "--seq-length", "32"]) == 0
    return {"text": str(root / "sums_text_document"), "sft": str(root / "asks")}


def _record(path) -> dict:
    """{step: [loss, grad norm, steps skipped so far]} of a metrics file (a skipped fp16 step
    logs no finite norm)."""
    out, skipped = {}, 0
    for r in map(json.loads, open(path)):
        if "loss" not in r:
            continue
        norm = r.get("grad_norm")
        skipped += norm is None or not math.isfinite(norm)
        out[str(r["iteration"])] = [r["loss"], norm, skipped]
    return out


def run_all(framework: str, root: pathlib.Path) -> dict:
    """Every configuration's record on the bound framework (``framework``), run under ``root``."""
    from launch import run_configs

    from mindspeed_core import cli

    data = make_data(root)
    curves = {}
    launched = []
    for name, (ranks, source, flags) in CONFIGS.items():
        flags = [*flags, *(["--data-path", data[source]] if source else []), "--exit-interval", str(RUN_STEPS)]
        if ranks > 1:
            launched.append([name, flags, False])
            continue
        metrics = root / f"{name}.jsonl"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.chdir(root):  # the default saves under ./checkpoints
            assert cli.main(["train", *flags, "--metrics-file", str(metrics)]) == 0
        curves[name] = _record(metrics)
    (root / "launch").mkdir()
    out = run_configs(framework, 2, launched, root / "launch")
    for name, _, _ in launched:
        curves[name] = _record(out / f"{name}.jsonl")
    return {name: {"ranks": CONFIGS[name][0], "flags": CONFIGS[name][2], "steps": curves[name]} for name in CONFIGS}


def compare(got: dict, golden: dict) -> list[str]:
    """What moved beyond the tolerances, one line each (empty: nothing)."""
    problems = []
    for name in sorted(set(golden) | set(got)):
        if name not in got or name not in golden:
            problems.append(f"{name}: {'no golden values' if name in got else 'not run'}")
            continue
        if got[name]["flags"] != golden[name]["flags"] or got[name]["ranks"] != golden[name]["ranks"]:
            problems.append(f"{name}: its configuration changed since the golden values were written")
            continue
        want, have = golden[name]["steps"], got[name]["steps"]
        if sorted(want, key=int) != sorted(have, key=int):
            problems.append(f"{name}: logged steps {sorted(have, key=int)}, golden {sorted(want, key=int)}")
            continue
        for step in sorted(want, key=int):
            (loss, norm, skipped), (loss0, norm0, skipped0) = have[step], want[step]
            if abs(loss - loss0) > LOSS_TOL * abs(loss0):
                problems.append(f"{name} step {step}: loss {loss!r}, golden {loss0!r}")
            if (norm is None) != (norm0 is None) or (norm is not None and abs(norm - norm0) > NORM_TOL * abs(norm0)):
                problems.append(f"{name} step {step}: grad norm {norm!r}, golden {norm0!r}")
            if skipped != skipped0:
                problems.append(f"{name} step {step}: {skipped} steps skipped, golden {skipped0}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ai-framework", choices=("pytorch", "mindspore"), required=True)
    framework = parser.parse_args().ai_framework
    os.environ["MINDSPEED_AI_FRAMEWORK"] = framework
    sys.path.insert(0, str(HERE))
    import tempfile

    from mindspeed_core import runtime

    runtime.bind(framework)
    with tempfile.TemporaryDirectory() as tmp:
        curves = run_all(framework, pathlib.Path(tmp))
    GOLDEN.mkdir(exist_ok=True)
    path = GOLDEN / f"{framework}.json"
    path.write_text(json.dumps(curves, indent=1) + "\n")
    print(f"wrote {path}: review its diff before committing it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
