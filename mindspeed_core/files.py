"""Filesystem safety shared by checkpoints and preprocessing: probing that an output folder
can be written before any work is done, fsync of folders, and removing the temporaries
that a killed process left behind (named ``<something>.tmp-<pid>...``)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from mindspeed_core.errors import MindSpeedError


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(path: str, what: str) -> None:
    """Refuse a folder that cannot be created or written (``what`` names it for the user,
    e.g. "--save ckpt"). Probes by creating and removing a folder in the nearest existing
    ancestor, which also catches read-only filesystems and files standing where a folder
    must be (root ignores permission bits, a probe does not); leaves nothing behind."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise MindSpeedError(f"{what} is a file, not a folder")
    parent = full
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise MindSpeedError(f"{what} cannot be created: {parent} is not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mindspeed-write-probe-", dir=parent))
    except OSError as exc:
        raise MindSpeedError(f"{what} is not writable ({parent}: {exc.strerror or exc})") from None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale(folder: str, pattern: re.Pattern, keep=lambda match: False) -> list[str]:
    """Delete entries of ``folder`` whose name matches ``pattern`` (its group "pid" the
    writer's pid) when that process no longer runs and ``keep(match)`` is false. Another
    live process's temporaries are left alone. Returns the names removed."""
    if not os.path.isdir(folder):
        return []
    removed = []
    for name in sorted(os.listdir(folder)):
        match = pattern.match(name)
        if not match or pid_alive(int(match.group("pid"))) or keep(match):
            continue
        path = os.path.join(folder, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        removed.append(name)
    return removed
