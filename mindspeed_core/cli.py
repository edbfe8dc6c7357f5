"""The ``mindspeed`` command.

    mindspeed features [--ai-framework X] [--device D] [--format text|markdown|json]
    mindspeed check-args [--ai-framework X] [--device D] <Megatron-style flags ...>
    mindspeed info [--ai-framework X] [--device D] [--measure]
    mindspeed train [--ai-framework X] <Megatron-style training flags ...>
    mindspeed preprocess --input FILE --output-prefix PREFIX [--tokenizer-type ...]
    mindspeed launch --nproc-per-node N [--nnodes --node-rank --master-addr --master-port] -- <train flags>

``--ai-framework`` is read before anything else so that the facade is bound before model
code is imported. Errors the user can act on print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
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
    active = features.validate(args, backend.NAME, device)
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
    features.validate(args, backend.NAME, device)  # before anything heavy is built
    from mindspeed_core.training.trainer import Trainer

    trainer = Trainer(args)
    if args.dry_run:
        if trainer.ps.rank == 0:
            print(json.dumps(trainer.describe(), indent=2))
        return 0
    try:
        trainer.run()
    finally:
        backend.dist.shutdown()
    return 0


def _cmd_preprocess(argv: list[str]) -> int:
    from mindspeed_core.data import preprocess

    parser = megatron_args.ArgumentParser(prog="mindspeed preprocess", description="text -> Megatron .bin/.idx")
    preprocess.add_args(parser)
    counts = preprocess.run(parser.parse_args(argv))
    print(f"wrote {counts['documents']} documents, {counts['tokens']} tokens: {', '.join(counts['outputs'])}")
    return 0


def launch_command(args, train_argv: list[str], framework: str) -> tuple[list[str], dict]:
    """The torchrun or msrun command line (and environment) that runs `train` on every rank."""
    import os

    env = dict(os.environ, MINDSPEED_AI_FRAMEWORK=framework)
    # msrun starts its workers with the "python" on PATH: make it this interpreter
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if framework == "pytorch":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}",
               f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
               f"--master-port={args.master_port}", "-m", "mindspeed_core.cli", "train", *train_argv]
    else:
        msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
        cmd = [msrun if os.path.exists(msrun) else "msrun", f"--worker_num={args.nproc_per_node * args.nnodes}",
               f"--local_worker_num={args.nproc_per_node}", f"--master_addr={args.master_addr}",
               f"--master_port={args.master_port}", f"--node_rank={args.node_rank}", "--join=True",
               f"--log_dir={args.log_dir}", os.path.abspath(__file__), "train", *train_argv]
    return cmd, env


def _cmd_launch(argv: list[str]) -> int:
    import subprocess

    if "--" in argv:
        cut = argv.index("--")
        own, train_argv = argv[:cut], argv[cut + 1:]
    else:
        own, train_argv = argv, []
    parser = megatron_args.ArgumentParser(prog="mindspeed launch", description="run `mindspeed train` on several ranks "
                                     "with torchrun (pytorch) or msrun (mindspore)")
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--log-dir", default="msrun_log", help="msrun's per-worker logs")
    parser.add_argument("--print-command", action="store_true", help="show the launcher command and exit")
    args = parser.parse_args(own)
    flag, _ = runtime.framework_flag(train_argv)
    framework = runtime.resolve(flag)
    cmd, env = launch_command(args, train_argv, framework)
    if args.print_command:
        print(" ".join(cmd))
        return 0
    # Relay the launcher's output and, when the job fails, name the rank that failed: torchrun
    # and msrun both say it, in different words, among many lines.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    root = _RootCause()
    for line in proc.stdout:
        sys.stdout.write(line)
        root.note_workers(proc.pid)
        root.feed(line)
    code = proc.wait()
    if code != 0:
        who = f"rank {root.failed} failed first" if root.failed is not None else "a rank failed"
        hint = ""
        if "--save" in train_argv:
            hint = f"; rerun with --load {train_argv[train_argv.index('--save') + 1]} to resume from its last checkpoint"
        print(f"mindspeed launch: {who}; the job stopped (exit code {code}){hint}", file=sys.stderr)
    return code


class _RootCause:
    """Finds the rank that failed first in a launcher's output. torchrun lists it under
    "Root Cause (first observed failure)". msrun reports the first worker process that
    exited by its pid, so the worker pids are mapped to ranks (their RANK_ID) while they
    live; msrun's "first one timed out" is only a fallback, since a surviving rank blocked
    in a collective can time out first."""

    def __init__(self):
        self.rank, self._in_root, self._pids, self._timed_out = None, False, {}, None

    def note_workers(self, launcher_pid: int) -> None:
        import os

        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) in self._pids:
                continue
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
                if parent != launcher_pid:
                    continue
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    env = dict(e.split(b"=", 1) for e in fh.read().split(b"\0") if b"=" in e)
            except (OSError, ValueError, IndexError):
                continue
            if b"RANK_ID" in env and b"MS_NODE_ID" in env:  # workers, not the scheduler
                self._pids[int(pid)] = int(env[b"RANK_ID"])

    def feed(self, line: str) -> None:
        import re

        if "Root Cause" in line:
            self._in_root = True
        m = re.search(r"^\s*rank\s*:\s*(\d+)", line)
        if m and self._in_root and self.rank is None:
            self.rank = int(m.group(1))
        m = re.search(r"Worker process (\d+) exit with exception", line)
        if m and self.rank is None and int(m.group(1)) in self._pids:
            self.rank = self._pids[int(m.group(1))]
        m = re.search(r"worker (\d+) is the first one timed out", line)
        if m and self._timed_out is None:
            self._timed_out = int(m.group(1))

    @property
    def failed(self):
        return self.rank if self.rank is not None else self._timed_out


COMMANDS = {"features": _cmd_features, "check-args": _cmd_check_args, "info": _cmd_info, "train": _cmd_train,
            "preprocess": _cmd_preprocess, "launch": _cmd_launch}


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
