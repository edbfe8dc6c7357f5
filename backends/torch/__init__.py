"""The PyTorch backend: CPU, CUDA, and Ascend NPU through torch_npu when present.

This module imports no framework: it declares what the rest of the project needs to know about
the backend without binding it (its name, the package it needs, how its launcher starts a job).
Binding imports :mod:`.facade`, which imports torch and the facade's modules.
"""

from __future__ import annotations

import sys

NAME = "pytorch"
IMPORT_NAME = "torch"  # the framework's own package
EXTRA = "torch"  # pip install 'mindspeed-core[<EXTRA>]'
FACADE = f"{__name__}.facade"
LAUNCHER = "torchrun"
LAUNCH_ENV: dict = {}  # what the launcher's ranks get besides the caller's environment


def launch_command(nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str, master_port: int,
                   log_dir: str, script: str | None = None, command: str = "train") -> list[str]:
    """torchrun's command line that runs `mindspeed <command>` (or the Python file ``script``)
    on every rank; the arguments follow it. Each rank's output is the launcher's (``log_dir``
    is msrun's)."""
    entry = [script] if script else ["-m", "mindspeed_core.cli", command]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}",
            f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}", *entry]
