"""Start a script on several ranks with the launcher of the selected framework."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(framework: str, nproc: int, script: str, args: list[str], log_dir: str, timeout: int = 300):
    """Run ``script`` on ``nproc`` local ranks; returns (exit code, combined launcher output)."""
    env = dict(os.environ)
    env["MINDSPEED_AI_FRAMEWORK"] = framework
    env["OMP_NUM_THREADS"] = "1"  # several ranks share two cores
    # msrun starts workers with the "python" on PATH: make it this interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    port = str(free_port())
    if framework == "pytorch":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}",
               script, *args]
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "msrun"), f"--worker_num={nproc}",
               f"--local_worker_num={nproc}", f"--master_port={port}", "--join=True", f"--log_dir={log_dir}",
               script, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        out, _ = proc.communicate()
        return -1, out + f"\n[timed out after {timeout}s]"
    logs = ""
    if os.path.isdir(log_dir):
        for name in sorted(os.listdir(log_dir)):
            with open(os.path.join(log_dir, name), errors="replace") as fh:
                logs += f"\n--- {name} ---\n" + fh.read()[-4000:]
    return proc.returncode, out + logs
