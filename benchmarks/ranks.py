"""Run a benchmark script on several local ranks with the framework's launcher (torchrun or
msrun, the command line `mindspeed launch` builds), as the benchmarks' rank-worker mode expects."""

from __future__ import annotations

import os
import subprocess

from mindspeed_core.launcher import local_script_command


def launch(framework: str, nproc: int, script_argv: list[str], folder: str, threads: int = 1) -> None:
    """Run ``script_argv`` (a script path and its arguments) on ``nproc`` ranks in ``folder``;
    exits with the launcher's output and the ranks' logs if it fails."""
    logs = os.path.join(folder, "logs")
    cmd, env = local_script_command(nproc, script_argv[0], script_argv[1:], framework, logs)
    env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder)
    if done.returncode:
        text = ""
        if os.path.isdir(logs):
            text = "".join(open(os.path.join(logs, f), errors="replace").read()[-2000:] for f in sorted(os.listdir(logs)))
        raise SystemExit(f"{framework} on {nproc} ranks failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}{text}")
