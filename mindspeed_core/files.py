"""Filesystem safety shared by checkpoints and preprocessing: probing that an output folder
can be written before any work is done, fsync of folders, removing the temporaries that a
killed process left behind (named ``<something>.tmp-<pid>...``), and publishing several files
as one step (a journal that a reader or the next writer rolls forward)."""

from __future__ import annotations

import json
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


def read_text(file: str, what: str = "") -> str:
    """A file's text, which must be UTF-8: a binary or Latin-1 file is one line naming the line
    and byte where it stops being text."""
    with open(file, "rb") as fh:
        raw = fh.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise MindSpeedError(f"{what}{file}:{line} is not UTF-8 text (byte 0x{raw[exc.start]:02x}); save it as "
                             "UTF-8") from None


def write_atomically(path: str, text: str) -> None:
    """``path`` holds ``text`` entirely or is as it was (a temporary renamed into place)."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(temporary, path)


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


JOURNAL_SUFFIX = ".publishing.json"
_JOURNAL_TEMP = re.compile(r".*" + re.escape(JOURNAL_SUFFIX) + r"\.tmp-(?P<pid>\d+)$")


def publish_together(renames: list, journal: str) -> None:
    """Move each finished temporary onto its final name, as one step: the list is written to
    ``journal`` (atomically) before the first move and removed after the last. A process killed
    in between leaves the journal, and whoever looks next (:func:`finish_publishing`: the
    next writer, or a reader of the folder) completes the moves, so the final names hold all
    the old files or all the new ones, never a mix. Every path is in ``journal``'s folder."""
    folder = os.path.dirname(os.path.abspath(journal))
    for temporary, _ in renames:  # the data is on disk before anything points at it
        with open(temporary, "rb+") as fh:
            os.fsync(fh.fileno())
    staged = f"{journal}.tmp-{os.getpid()}"
    with open(staged, "w") as fh:
        json.dump([[os.path.basename(t), os.path.basename(f)] for t, f in renames], fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(staged, journal)
    fsync_dir(folder)
    _roll_forward(journal)


def _roll_forward(journal: str) -> None:
    folder = os.path.dirname(os.path.abspath(journal))
    with open(journal) as fh:
        renames = json.load(fh)
    for temporary, final in renames:
        try:
            os.replace(os.path.join(folder, temporary), os.path.join(folder, final))
        except FileNotFoundError:  # moved already (by an earlier roll-forward, or another reader)
            pass
    fsync_dir(folder)
    try:
        os.remove(journal)
    except FileNotFoundError:
        pass


def finish_publishing(folder: str) -> list[str]:
    """Complete what an interrupted :func:`publish_together` began in ``folder`` (and drop
    journals that were never published); returns the journals completed."""
    if not os.path.isdir(folder):
        return []
    remove_stale(folder, _JOURNAL_TEMP)
    done = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(JOURNAL_SUFFIX):
            try:
                _roll_forward(os.path.join(folder, name))
            except FileNotFoundError:  # another process finished it first
                continue
            except (OSError, ValueError, TypeError) as exc:
                raise MindSpeedError(f"{os.path.join(folder, name)}: an interrupted write left this journal and it "
                                     f"cannot be completed ({exc}); remove it and write that output again") from None
            done.append(name)
    return done
