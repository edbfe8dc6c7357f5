"""The ``mindspeed`` command.

    mindspeed features [--ai-framework X] [--device D] [--format text|markdown|json]
    mindspeed check-args [--ai-framework X] [--device D] <the flags of mindspeed train ...>
    mindspeed info [--ai-framework X] [--device D] [--measure]
    mindspeed train [--ai-framework X] <Megatron-style training flags ...>
    mindspeed generate (--load DIR | --load-hf FOLDER) [--prompt TEXT] [--task greedy do_sample beam_search ...]
    mindspeed generate (--load DIR | --load-hf FOLDER) --task chat [--prompt-type NAME | --hf-chat-template]
    mindspeed evaluate (--load DIR | --load-hf FOLDER) --task mmlu|ceval|gsm8k|boolq|perplexity --task-data-path P
    mindspeed preprocess --input FILE --output-prefix PREFIX [--tokenizer-type ...]
    mindspeed convert --load-model-type hf|mg --save-model-type hf|mg --load-dir D --save-dir D [--target-* ...]
    mindspeed plot METRICS.jsonl [more runs ...] -o curves.png [--labels A B ...]
    mindspeed plan (--model-name P | <model flags> | --load-hf FOLDER) --devices N --memory-per-device GB [--measure]
    mindspeed launch --nproc-per-node N [--nnodes --node-rank --master-addr --master-port] -- [generate|evaluate] <flags>

Every verb goes the same way: its flags are parsed once, the framework is bound once (the
``--ai-framework`` flag, else ``$MINDSPEED_AI_FRAMEWORK``, else pytorch), then the verb runs.
``preprocess``, ``convert`` and ``plot`` run no framework code and bind none. Errors the user can act on print one line and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Callable

from mindspeed_core import convert, evaluation, features, inference, launcher, planner, plot, runtime
from mindspeed_core.compat import megatron_args
from mindspeed_core.data import preprocess
from mindspeed_core.errors import MindSpeedError, Stopped
from mindspeed_core.training import configuration
from mindspeed_core.training.trainer import Trainer


def _features_parser():
    parser = megatron_args.ArgumentParser(prog="mindspeed features", description="print the feature matrix")
    megatron_args.add_framework_args(parser)
    parser.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    parser.add_argument("--update-readme", metavar="FILE", default=None,
                        help="rewrite the table between the feature-matrix markers of FILE")
    return parser


def _features(args, backend) -> int:
    if args.update_readme:
        features.update_readme(args.update_readme)
        print(f"updated the feature table in {args.update_readme}")
        return 0
    framework = backend.NAME if args.ai_framework else None  # without the flag: every framework's column
    device = args.device
    if device is not None:
        device = runtime.DEVICE_ALIASES.get(device, device)
        if device not in features.DEVICES:
            raise MindSpeedError(f"unknown device {args.device!r} for the matrix; choose one of {', '.join(features.DEVICES)}")
    if args.format == "json":
        out = features.render_json(framework, device)
    elif args.format == "markdown":
        out = features.render_markdown(framework)
    else:
        out = features.render_text(framework, device)
    sys.stdout.write(out if out.endswith("\n") else out + "\n")
    return 0


def _check_args_parser():
    parser = megatron_args.training_parser("mindspeed check-args")
    parser.description = ("check the flags of `mindspeed train` against the feature matrix and the configuration "
                          "rules, building nothing")
    return parser


def _check_args(args, backend) -> int:
    device = backend.device.type()
    active = features.validate(args, backend.NAME, device, backend.FRAMEWORK_VERSION)
    # under a launcher, the job's ranks; alone, the fewest the layout needs (one data-parallel
    # replica per expert-parallel rank)
    world = backend.dist.launched_world_size()
    if world == 1:
        world = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
                 * args.expert_model_parallel_size)
    configuration.configure(args, world)
    names = ", ".join(f.id for f in active) or "none"
    print(f"ok: {backend.NAME} on {device}, {world} rank{'s' if world > 1 else ''}; features requested: {names}")
    return 0


def _info_parser():
    parser = megatron_args.ArgumentParser(prog="mindspeed info", description="show the bound framework and its kernels")
    megatron_args.add_framework_args(parser)
    parser.add_argument("--measure", action="store_true", help="also measure the device's float32 matmul rate")
    parser.add_argument("--json", action="store_true")
    return parser


def _info(args, backend) -> int:
    info = {
        "framework": backend.NAME,
        "framework_version": backend.FRAMEWORK_VERSION,
        "device": backend.device.current(),
        "devices_available": backend.device.available(),
        "implementations": runtime.implementations(),
    }
    if args.measure:
        info["matmul_gflops_fp32"] = round(backend.device.matmul_rate() / 1e9, 1)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for group, kinds in value.items():
                text = kinds if isinstance(kinds, str) else ", ".join(f"{k}={v}" for k, v in kinds.items())
                print(f"  {group}: {text}")
        else:
            print(f"{key}: {value}")
    return 0


def _train(args, backend) -> int:
    features.validate(args, backend.NAME, backend.device.type(), backend.FRAMEWORK_VERSION)  # before anything heavy
    trainer = Trainer(args)
    if args.dry_run:
        if trainer.ps.rank == 0:
            print(json.dumps(trainer.describe(), indent=2))
        return 0
    try:
        trainer.run()
    except BaseException:
        backend.dist.shutdown(wait=False)  # the peers may be gone: do not wait for them
        raise
    backend.dist.shutdown()
    return 0


def _preprocess_parser():
    parser = megatron_args.ArgumentParser(prog="mindspeed preprocess", description="text -> Megatron .bin/.idx")
    megatron_args.add_framework_args(parser)
    preprocess.add_args(parser)
    return parser


def _preprocess(args, backend=None) -> int:
    counts = preprocess.run(args)
    print(f"wrote {counts['documents']} documents, {counts['tokens']} tokens: {', '.join(counts['outputs'])}")
    if counts.get("template"):
        print(f"template: {counts['template']}")
    for change in ("dropped", "cut"):
        if counts.get(change):
            print(f"{counts[change]} samples longer than --seq-length + 1 tokens were {change} (--truncation)")
    if counts["end_of_document"]:
        print(f"end of document: {counts['end_of_document']}")
    for key, p in counts.get("packing", {}).items():
        print(f"{key}: packed into {p['packs']} samples ({100 * p['fill']:.1f}% filled, the rest padding left out "
              f"of the loss)" + (f"; {p['split_documents']} documents longer than a sample cut into sample-long "
                                 "pieces" if p["split_documents"] else ""))
    return 0


@dataclasses.dataclass(frozen=True)
class Verb:
    """One verb: how its flags are parsed (once), and what runs once the framework is bound
    (``run(args, backend)``; ``backend`` is None for a verb that binds none)."""

    parse: Callable[[list], object]
    run: Callable[[object, object], int]
    binds: bool = True
    announce: bool = False  # at a clean end, say on stderr which framework ran (output that does not name it)


def _parse_with(make_parser):
    return lambda argv: make_parser().parse_args(argv)


COMMANDS = {
    "features": Verb(_parse_with(_features_parser), _features),
    "check-args": Verb(_parse_with(_check_args_parser), _check_args),
    "info": Verb(_parse_with(_info_parser), _info),
    "train": Verb(_parse_with(megatron_args.training_parser), _train),
    "generate": Verb(_parse_with(inference.parser), inference.run, announce=True),
    "evaluate": Verb(_parse_with(evaluation.parser), evaluation.run, announce=True),
    # framework-free: they accept --ai-framework (scripts pass it) and import no framework, so a
    # machine with only one of them installed (or neither) preprocesses and converts
    "preprocess": Verb(_parse_with(_preprocess_parser), _preprocess, binds=False),
    "convert": Verb(_parse_with(convert.parser), convert.run, binds=False),
    "plot": Verb(_parse_with(plot.parser), plot.run, binds=False),
    "plan": Verb(planner.parse, planner.run, announce=True),
    "launch": Verb(launcher.parse, launcher.run, announce=True),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = __doc__.strip().split("\n\n")[1]
    if argv[:1] in (["-h"], ["--help"]):
        print("usage:\n" + usage)
        return 0
    if not argv or argv[0] not in COMMANDS:
        what = f"unknown command {argv[0]!r}" if argv else "a command is required"
        print(f"mindspeed: error: {what}\nusage:\n{usage}", file=sys.stderr)
        return 2
    verb = COMMANDS[argv[0]]
    try:
        args = verb.parse(argv[1:])
        backend = runtime.bind(args.ai_framework, args.device) if verb.binds else None
        code = verb.run(args, backend)
    except Stopped as exc:  # not an error: what was asked (save and leave on a signal) was done
        print(f"mindspeed {argv[0]}: {exc}", file=sys.stderr)
        return exc.exit_code
    except MindSpeedError as exc:
        line = f"mindspeed {argv[0]}: error: {exc}"
        print(line, file=sys.stderr)
        launcher.note_rank_error(line, exc.exit_code)
        return exc.exit_code
    if verb.announce and code == 0:  # at the end: a refusal stays one line
        print(f"mindspeed {argv[0]}: ran on {backend.NAME} {backend.FRAMEWORK_VERSION} ({backend.device.type()})",
              file=sys.stderr)
    return code


def console() -> None:
    """The `mindspeed` command (pyproject's script): main, then runtime.exit_process."""
    runtime.exit_process(main())


if __name__ == "__main__":
    console()
