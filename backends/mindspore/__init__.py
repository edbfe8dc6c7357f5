"""The MindSpore backend (PyNative mode): CPU, GPU or Ascend.

This module imports no framework: it declares what the rest of the project needs to know about
the backend without binding it (its name, the package it needs, how its launcher starts a job).
Binding imports :mod:`.facade`, which imports mindspore and the facade's modules.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# MindSpore logs every probe of an absent device (Ascend, GPU) as warnings; keep its C++ and
# Python logs to errors unless the user chose a level (here: before any module of this
# backend imports mindspore)
os.environ.setdefault("GLOG_v", "3")

NAME = "mindspore"
IMPORT_NAME = "mindspore"  # the framework's own package
EXTRA = "mindspore"  # pip install 'mindspeed-core[<EXTRA>]'
FACADE = f"{__name__}.facade"
LAUNCHER = "msrun"
# MindSpore's cluster start-up: a worker that reaches msrun's scheduler before it listens
# retries after 3-5 s by default. Retrying within a second starts a two-rank job here about
# 5 s sooner (20 -> 15 s for an empty job); a value the user set wins.
LAUNCH_ENV = {"MS_RETRY_INTERVAL_LOWER": "0", "MS_RETRY_INTERVAL_UPPER": "1"}


def launch_command(nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str, master_port: int,
                   log_dir: str, script: str | None = None, command: str = "train") -> list[str]:
    """msrun's command line that runs `mindspeed <command>` (or the Python file ``script``) on
    every rank, each rank's output in ``log_dir``; the arguments follow it. msrun starts its
    workers with the ``python`` on PATH (the launcher puts this interpreter's folder first)."""
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    entry = [script] if script else [importlib.util.find_spec("mindspeed_core.cli").origin, command]
    return [msrun if os.path.exists(msrun) else "msrun", f"--worker_num={nproc_per_node * nnodes}",
            f"--local_worker_num={nproc_per_node}", f"--master_addr={master_addr}", f"--master_port={master_port}",
            f"--node_rank={node_rank}", "--join=True", f"--log_dir={log_dir}", *entry]
