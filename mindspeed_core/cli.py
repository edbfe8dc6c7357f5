"""The ``mindspeed`` command.

    mindspeed features [--ai-framework X] [--device D] [--format text|markdown|json]
    mindspeed check-args [--ai-framework X] [--device D] <Megatron-style flags ...>
    mindspeed info [--ai-framework X] [--device D] [--measure]
    mindspeed train [--ai-framework X] <Megatron-style training flags ...>
    mindspeed generate (--load DIR | --load-hf FOLDER) --prompt TEXT [--task greedy|do_sample|beam_search ...]
    mindspeed generate (--load DIR | --load-hf FOLDER) --task chat [--prompt-type NAME | --hf-chat-template]
    mindspeed evaluate (--load DIR | --load-hf FOLDER) --task mmlu|ceval|gsm8k|boolq|perplexity --task-data-path P
    mindspeed preprocess --input FILE --output-prefix PREFIX [--tokenizer-type ...]
    mindspeed convert --load-model-type hf|mg --save-model-type hf|mg --load-dir D --save-dir D [--target-* ...]
    mindspeed plot METRICS.jsonl [more runs ...] -o curves.png [--labels A B ...]
    mindspeed plan (--model-name P | <model flags> | --load-hf FOLDER) --devices N --memory-per-device GB [--measure]
    mindspeed launch --nproc-per-node N [--nnodes --node-rank --master-addr --master-port] -- [generate] <flags>

``--ai-framework`` is read before anything else so that the facade is bound before model
code is imported. Errors the user can act on print one line and exit with status 2.
"""

from __future__ import annotations

import json
import sys

from mindspeed_core import features, runtime
from mindspeed_core.compat import megatron_args
from mindspeed_core.errors import MindSpeedError


def _cmd_features(argv: list[str]) -> int:
    parser = megatron_args.ArgumentParser(prog="mindspeed features", description="print the feature matrix")
    megatron_args.add_framework_args(parser)
    parser.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    parser.add_argument("--update-readme", metavar="FILE", default=None,
                        help="rewrite the table between the feature-matrix markers of FILE")
    args = parser.parse_args(argv)
    if args.update_readme:
        features.update_readme(args.update_readme)
        print(f"updated the feature table in {args.update_readme}")
        return 0
    framework = runtime.check_name(args.ai_framework) if args.ai_framework else None
    device = args.device
    if device is not None:
        device = {"gpu": "cuda", "ascend": "npu"}.get(device, device)
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


def _bind(args):
    backend = runtime.bind(args.ai_framework, args.device)
    return backend, backend.device.type()


def _cmd_check_args(argv: list[str]) -> int:
    parser = megatron_args.feature_parser("mindspeed check-args")
    parser.description = "validate Megatron-style flags against the feature matrix for the selected framework"
    args = parser.parse_args(argv)
    backend, device = _bind(args)
    active = features.validate(args, backend.NAME, device, backend.FRAMEWORK_VERSION)
    names = ", ".join(f.id for f in active) or "none"
    print(f"ok: {backend.NAME} on {device}; features requested: {names}")
    return 0


def _cmd_info(argv: list[str]) -> int:
    parser = megatron_args.ArgumentParser(prog="mindspeed info", description="show the bound framework and its kernels")
    megatron_args.add_framework_args(parser)
    parser.add_argument("--measure", action="store_true", help="also measure the device's float32 matmul rate")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    backend, device = _bind(args)
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


def _cmd_train(argv: list[str]) -> int:
    args = megatron_args.training_parser().parse_args(argv)
    backend, device = _bind(args)
    features.validate(args, backend.NAME, device, backend.FRAMEWORK_VERSION)  # before anything heavy is built
    from mindspeed_core.training.trainer import Trainer

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


def _cmd_preprocess(argv: list[str]) -> int:
    from mindspeed_core.data import preprocess

    parser = megatron_args.ArgumentParser(prog="mindspeed preprocess", description="text -> Megatron .bin/.idx")
    preprocess.add_args(parser)
    counts = preprocess.run(parser.parse_args(argv))
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


def _cmd_generate(argv: list[str]) -> int:
    from mindspeed_core import inference

    return inference.run(argv)


def _cmd_evaluate(argv: list[str]) -> int:
    from mindspeed_core import evaluation

    return evaluation.run(argv)


def _cmd_convert(argv: list[str]) -> int:
    from mindspeed_core import convert

    return convert.run(argv)


def _cmd_plot(argv: list[str]) -> int:
    from mindspeed_core import plot

    return plot.main(argv)


def _cmd_plan(argv: list[str]) -> int:
    from mindspeed_core import planner

    return planner.main(argv)


def _cmd_launch(argv: list[str]) -> int:
    from mindspeed_core import launcher

    return launcher.run(argv)


COMMANDS = {"features": _cmd_features, "check-args": _cmd_check_args, "info": _cmd_info, "train": _cmd_train,
            "generate": _cmd_generate, "evaluate": _cmd_evaluate, "preprocess": _cmd_preprocess, "launch": _cmd_launch,
            "convert": _cmd_convert, "plot": _cmd_plot, "plan": _cmd_plan}


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
    try:
        return COMMANDS[argv[0]](argv[1:])
    except MindSpeedError as exc:
        print(f"mindspeed {argv[0]}: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
