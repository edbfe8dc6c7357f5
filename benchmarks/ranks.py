"""Run a benchmark script on several local ranks with the framework's launcher (torchrun or
msrun), as the benchmarks' rank-worker mode expects."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(framework: str, nproc: int, script_argv: list[str], folder: str, threads: int = 1) -> None:
    """Run ``script_argv`` (a script path and its arguments) on ``nproc`` ranks in ``folder``;
    exits with the launcher's output and the ranks' logs if it fails."""
    env = dict(os.environ, MINDSPEED_AI_FRAMEWORK=framework, OMP_NUM_THREADS=str(threads))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # msrun's "python"
    logs = os.path.join(folder, "logs")
    if framework == "pytorch":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={_port()}",
               *script_argv]
    else:
        from mindspeed_core.launcher import MSRUN_ENV_DEFAULTS

        env = {**MSRUN_ENV_DEFAULTS, **env}
        cmd = [os.path.join(os.path.dirname(sys.executable), "msrun"), f"--worker_num={nproc}",
               f"--local_worker_num={nproc}", f"--master_port={_port()}", "--join=True", f"--log_dir={logs}",
               *script_argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder)
    if done.returncode:
        text = ""
        if os.path.isdir(logs):
            text = "".join(open(os.path.join(logs, f), errors="replace").read()[-2000:] for f in sorted(os.listdir(logs)))
        raise SystemExit(f"{framework} on {nproc} ranks failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}{text}")
