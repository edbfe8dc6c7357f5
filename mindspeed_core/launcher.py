"""`mindspeed launch`: run `mindspeed train` on several ranks with torchrun (PyTorch) or
msrun (MindSpore), and behave as a job scheduler expects.

- The training flags are checked once here, before any rank starts: a bad flag is one
  line and exit 2, as without `launch`.
- The launcher and every process it starts (torchrun puts its workers in sessions of their
  own, msrun adds a scheduler and log tails) are watched through /proc; SIGTERM, SIGINT or
  SIGHUP to `mindspeed launch` is passed to all of them, and whatever still runs after a
  grace period is killed, so nothing is left training as an orphan.
- When the job fails, the process that died first is named: a rank, or msrun's scheduler.
  The job ends then and there: msrun's scheduler (after a rank failed) and msrun's ranks
  (after their scheduler died) would otherwise wait out a heartbeat timeout, about 30 s.
- Across nodes, gloo (the CPU collectives of torch and MindSpore) would listen on the address
  the hostname resolves to, often a loopback one that the other nodes cannot reach: unless
  GLOO_SOCKET_IFNAME is set, it is set to the interface that routes to --master-addr.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

from mindspeed_core import evaluation, features, inference, runtime
from mindspeed_core.backends.common import check_fits_in_memory
from mindspeed_core.compat import megatron_args
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.training import configuration

GRACE_SECONDS = 15.0  # after the forwarded signal, before SIGKILL (a scheduler's own grace is ~30 s)
POLL_SECONDS = 0.5
# msrun's scheduler may leave before its ranks at a clean end too (they deregister, it exits,
# they are still tearing down): ranks that outlive a scheduler that did not exit cleanly (or
# whose exit status was not seen) by this long were cut off mid-run
SCHEDULER_GRACE_SECONDS = 5.0
SCHEDULER = "the msrun scheduler"  # the role Watch gives msrun's scheduler process


def parser():
    p = megatron_args.ArgumentParser(prog="mindspeed launch", description="run `mindspeed train` on several ranks "
                                     "with torchrun (pytorch) or msrun (mindspore)")
    p.add_argument("--nproc-per-node", type=megatron_args.POSITIVE_INT, required=True)
    p.add_argument("--nnodes", type=megatron_args.POSITIVE_INT, default=1)
    p.add_argument("--node-rank", type=megatron_args.COUNT, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=megatron_args.PORT, default=29500)
    p.add_argument("--log-dir", default="msrun_log", help="msrun's per-worker logs")
    p.add_argument("--ai-framework", choices=("pytorch", "mindspore"), default=None,
                   help="may also stand after --, with the training flags")
    p.add_argument("--print-command", action="store_true", help="show the launcher command and exit")
    return p


def interface_towards(address: str) -> str | None:
    """The name of the network interface this machine reaches ``address`` through (Linux),
    or None when that cannot be told."""
    try:
        target = socket.gethostbyname(address)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # a datagram socket sends nothing: the kernel just picks the route
            local = s.getsockname()[0]
    except OSError:
        return None
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if _ipv4_address(name) == local), None)


def _ipv4_address(interface: str) -> str | None:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            request = struct.pack("256s", interface.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
        except OSError:  # no IPv4 address on it
            return None


def launch_command(args, train_argv: list[str], framework: str, command: str = "train",
                   script: str | None = None) -> tuple[list[str], dict]:
    """The framework's launcher command line (backends/<name>/__init__.py: torchrun, msrun) and
    environment that runs `train` (or `generate`, `evaluate`) on every rank; with ``script``,
    that Python file with ``train_argv`` instead."""
    backend = runtime.declaration(framework)
    env = {**backend.LAUNCH_ENV, **os.environ, "MINDSPEED_AI_FRAMEWORK": framework}
    if args.nnodes > 1 and not env.get("GLOO_SOCKET_IFNAME"):
        interface = interface_towards(args.master_addr)
        if interface:
            env["GLOO_SOCKET_IFNAME"] = interface
    # msrun starts its workers with the "python" on PATH: make it this interpreter
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if args.nproc_per_node > 1:  # as torchrun does for its ranks: the ranks of a node share its cores
        env.setdefault("OMP_NUM_THREADS", "1")
    cmd = backend.launch_command(args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr,
                                 args.master_port, args.log_dir, script, command)
    return [*cmd, *train_argv], env


def local_script_command(nproc: int, script: str, script_argv: list[str], framework: str,
                         log_dir: str) -> tuple[list[str], dict]:
    """launch_command for a Python file on ``nproc`` ranks of this machine, on a free port (the
    planner's probe of the collectives, the benchmarks' rank workers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = types.SimpleNamespace(nproc_per_node=nproc, nnodes=1, node_rank=0, master_addr="127.0.0.1",
                                 master_port=port, log_dir=log_dir)
    return launch_command(args, script_argv, framework, script=script)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def _check_training_flags(args, backend) -> None:
    """What each rank would refuse, refused here once: one line, exit 2, no rank started."""
    targs = args.rank_args
    features.validate(targs, backend.NAME, backend.device.type(), backend.FRAMEWORK_VERSION)
    cfg = configuration.configure(targs, args.nproc_per_node * args.nnodes).model
    if not targs.dry_run and backend.device.type() == "cpu":
        check_fits_in_memory(args.nproc_per_node * configuration.memory_needed(cfg, targs.tensor_model_parallel_size),
                             f"{args.nproc_per_node} ranks of this {cfg.num_parameters():,}-parameter model")


def _check_port(args) -> None:
    """On the node that hosts the rendezvous, the port must be free (a listener holds it;
    TIME_WAIT leftovers do not count, as the launchers reuse the address)."""
    if args.node_rank != 0:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", args.master_port))
        except OSError as exc:
            raise MindSpeedError(f"--master-port {args.master_port} is already in use ({exc.strerror}): "
                                 f"choose another port with --master-port") from None


def _say_interface(args, env: dict) -> None:
    chosen = env.get("GLOO_SOCKET_IFNAME")
    if chosen and chosen != os.environ.get("GLOO_SOCKET_IFNAME"):
        print(f"mindspeed launch: GLOO_SOCKET_IFNAME={chosen}, the interface that reaches --master-addr "
              f"{args.master_addr} (set GLOO_SOCKET_IFNAME to choose another)", file=sys.stderr)
    elif not chosen:
        print(f"mindspeed launch: cannot tell which network interface reaches --master-addr {args.master_addr}; "
              f"if the nodes fail to connect, set GLOO_SOCKET_IFNAME to it", file=sys.stderr)


def parse(argv: list[str]):
    """The launcher's own flags (before ``--``) and the ranks' (after it, parsed here as each rank
    parses them: a bad flag is one line and no rank starts). ``--ai-framework`` may stand on
    either side; the two must agree."""
    own, rank_argv = _split(argv)
    command = "train"
    if rank_argv[:1] in (["generate"], ["evaluate"]):  # `mindspeed launch ... -- generate ...`: on every rank
        command, rank_argv = rank_argv[0], rank_argv[1:]
    args = parser().parse_args(own)
    if args.node_rank >= args.nnodes:
        raise MindSpeedError(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes}")
    try:
        socket.getaddrinfo(args.master_addr, args.master_port)
    except (OSError, UnicodeError):
        raise MindSpeedError(f"--master-addr {args.master_addr!r} is neither an address nor a host name this machine "
                             "can resolve") from None
    rank_args = {"train": megatron_args.training_parser, "generate": inference.parser,
                 "evaluate": evaluation.parser}[command]().parse_args(rank_argv)
    if args.ai_framework and rank_args.ai_framework and rank_args.ai_framework != args.ai_framework:
        raise MindSpeedError(f"--ai-framework {args.ai_framework} before -- and --ai-framework "
                             f"{rank_args.ai_framework} after it disagree")
    if args.ai_framework and not rank_args.ai_framework:  # the ranks' command line names it too
        rank_argv = ["--ai-framework", args.ai_framework, *rank_argv]
    # the ranks bind what this process binds (the launchers also pass it on in MINDSPEED_AI_FRAMEWORK)
    args.ai_framework = args.ai_framework or rank_args.ai_framework
    args.device = rank_args.device
    args.command, args.rank_argv, args.rank_args = command, rank_argv, rank_args
    return args


def run(args, backend) -> int:
    command, train_argv = args.command, args.rank_argv
    framework = backend.NAME
    cmd, env = launch_command(args, train_argv, framework, command)
    if args.print_command:
        print(" ".join(cmd))
        return 0
    if command == "train":
        _check_training_flags(args, backend)
    _check_port(args)
    if args.nnodes > 1:
        _say_interface(args, env)
    errors = tempfile.mkdtemp(prefix="mindspeed-launch-")
    env[ERRORS_ENV] = errors
    try:
        job = Job(cmd, env, runtime.declaration(framework).LAUNCHER)
        code = job.run()
        reason = _rank_error(errors, job.culprit()) if code != 0 and job.stopped_by is None else None
    finally:
        shutil.rmtree(errors, ignore_errors=True)
    if job.stopped_by is not None:
        name = signal.Signals(job.stopped_by).name
        print(f"mindspeed launch: {name} received: the job's {job.stopped_count} processes were stopped "
              f"(the last checkpoint on disk is intact)", file=sys.stderr)
        return 128 + job.stopped_by
    if code != 0:
        hint = ""
        if "--save" in train_argv and train_argv.index("--save") + 1 < len(train_argv):
            hint = f"; rerun with --load {train_argv[train_argv.index('--save') + 1]} to resume from its last checkpoint"
        if reason is not None:  # the failed rank's own words, and its exit code (2: a refusal)
            print(reason[0], file=sys.stderr)
            code = reason[1] if reason[1] == 2 else code
        print(f"mindspeed launch: {job.culprit()}; the job stopped (exit code {code}){hint}", file=sys.stderr)
    return code if code >= 0 else 128 - code  # killed by signal N: the shell's 128 + N


ERRORS_ENV = "MINDSPEED_RANK_ERRORS"  # a folder `launch` gives its ranks for their one-line errors


def note_rank_error(line: str, code: int) -> None:
    """A rank started by `mindspeed launch` leaves its one-line error (and exit code) where the
    launcher finds it: on stdout, among torchrun's and msrun's output, nobody would."""
    folder = os.environ.get(ERRORS_ENV)
    rank = os.environ.get("RANK", os.environ.get("RANK_ID"))
    if not folder or rank is None or not rank.isdigit():
        return
    try:
        with open(os.path.join(folder, f"rank_{int(rank)}"), "w") as fh:
            fh.write(f"{code}\n{line}")
    except OSError:
        pass


def _rank_error(folder: str, culprit: str) -> tuple[str, int] | None:
    """(one-line error, exit code) of the rank that failed first, else of the lowest failed rank."""
    m = re.match(r"rank (\d+) failed first", culprit)
    try:
        found = sorted((int(f[5:]), f) for f in os.listdir(folder) if f.startswith("rank_") and f[5:].isdigit())
    except OSError:
        return None
    chosen = [f for r, f in found if m and r == int(m.group(1))] or ([found[0][1]] if found and not m else [])
    if not chosen:
        return None
    try:
        with open(os.path.join(folder, chosen[0])) as fh:
            code, line = fh.read().split("\n", 1)
        return line.splitlines()[0], int(code)
    except (OSError, ValueError, IndexError):
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (the state first), None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _stat(pid: int):
    """(parent pid, start time) of a running process; None once it is gone or a zombie (msrun
    reaps a dead scheduler only when the job ends, so it lingers as one)."""
    fields = _stat_fields(pid)
    try:
        return None if not fields or fields[0] in "ZX" else (int(fields[1]), int(fields[19]))
    except (ValueError, IndexError):
        return None


def _exit_status(pid: int, start: int) -> int | None:
    """The wait status (as waitpid gives it: 0 for a clean exit, the signal's number when
    killed) of the process ``pid`` started at ``start``, if it has exited and its parent has not
    reaped it yet (a zombie); None otherwise."""
    fields = _stat_fields(pid)
    try:
        return int(fields[49]) if fields and fields[0] == "Z" and int(fields[19]) == start else None
    except (ValueError, IndexError):
        return None


def _cmdline(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return []


def _environ(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return dict(e.split(b"=", 1) for e in fh.read().split(b"\0") if b"=" in e)
    except (OSError, ValueError):
        return {}


class Watch:
    """The job's process tree, followed through /proc: which processes belong to it (kept
    even once re-parented, with their start times so a reused pid is never signalled), what
    role each has (a torchrun/msrun rank, msrun's scheduler), and which died first."""

    def __init__(self, root: int):
        self.root = root
        self.members: dict[int, int] = {}  # pid -> start time
        self.roles: dict[int, str] = {}  # pid -> "rank N" | SCHEDULER
        self.first_deaths: set[str] = set()  # the roles found gone in the first scan that found any
        self.torchrun_rank: int | None = None
        self.msrun_failed: str | None = None
        self.scheduler_stopped = False  # we stopped msrun's scheduler ourselves (after a rank failed)
        # msrun's scheduler seen exiting with status 0: at a clean end it may leave before its
        # ranks, which are still tearing down (seen taking over 5 s on a busy machine)
        self.scheduler_clean = False
        self._in_root = False
        self._lock = threading.RLock()  # the signal handler may scan while the main thread does

    def scan(self) -> None:
        parents = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _stat(int(name))
                if st:
                    parents[int(name)] = st
        with self._lock:
            grown = True
            while grown:  # the root's descendants, plus anything whose parent we already know
                grown = False
                for pid, (ppid, start) in parents.items():
                    if pid not in self.members and (ppid == self.root or ppid in self.members or pid == self.root):
                        self.members[pid] = start
                        grown = True
            for pid, (ppid, start) in parents.items():
                # until a child has exec'd, it shows msrun's own command line and environment
                if ppid == self.root and pid not in self.roles and self.members.get(pid) == start:
                    self._classify(pid)
            if not self.first_deaths:
                self.first_deaths = {role for pid, role in self.roles.items()
                                     if not (pid in parents and parents[pid][1] == self.members[pid])}
            for pid, role in self.roles.items():
                if (role == SCHEDULER and not self.scheduler_clean and pid not in parents
                        and _exit_status(pid, self.members[pid]) == 0):
                    self.scheduler_clean = True

    def _classify(self, pid: int) -> None:
        """Only msrun's own Python children have a role: their helpers (the
        `lscpu` MindSpore runs at import, msrun's `tail -f` of each log) inherit MS_ROLE and
        RANK_ID, and a scheduler's helper that exits would read as the scheduler dying."""
        argv = _cmdline(pid)
        if not argv or argv == _cmdline(self.root):
            return  # gone, or forked and not yet exec'd: it still shows msrun's own command line
        if not os.path.basename(argv[0].decode(errors="replace")).startswith("python"):
            return  # msrun starts its scheduler and workers with "python", its log tails with tail
        env = _environ(pid)
        if env.get(b"MS_ROLE") == b"MS_SCHED":
            self.roles[pid] = SCHEDULER
        elif b"RANK_ID" in env and b"MS_NODE_ID" in env:
            self.roles[pid] = f"rank {int(env[b'RANK_ID'])}"

    def alive(self) -> list[int]:
        with self._lock:
            return [pid for pid, start in self.members.items() if (_stat(pid) or (0, None))[1] == start]

    def signal_all(self, signum: int, role: str | None = None) -> int:
        """Send ``signum`` to every live process of the job (or only those with ``role``)."""
        pids = [pid for pid in self.alive() if role is None or self.roles.get(pid) == role]
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        return len(pids)

    def feed(self, line: str) -> None:
        """The launchers' own words: torchrun lists the first failure under "Root Cause (first
        observed failure)"; msrun reports the first worker that exited by its pid (its
        "first one timed out" can name a survivor blocked in a collective, so it is unused)."""
        if "Root Cause" in line:
            self._in_root = True
        m = re.search(r"^\s*rank\s*:\s*(\d+)", line)
        if m and self._in_root and self.torchrun_rank is None:
            self.torchrun_rank = int(m.group(1))
        m = re.search(r"Worker process (\d+) exit with exception", line)
        if m and self.msrun_failed is None:
            self.msrun_failed = self.roles.get(int(m.group(1)))

    def culprit(self) -> str:
        if self.torchrun_rank is not None:
            return f"rank {self.torchrun_rank} failed first"
        # found gone with ranks in one scan, the scheduler still went first: after a rank fails it
        # lingers for the heartbeat timeout (about 30 s) unless we stop it
        if SCHEDULER in self.first_deaths and not self.scheduler_stopped and not self.scheduler_clean:
            return "the msrun scheduler died first (not a rank)"
        if self.msrun_failed:
            return f"{self.msrun_failed} failed first"
        if len(self.first_deaths) == 1:
            return f"{next(iter(self.first_deaths))} failed first"
        return "a rank failed"


class Job:
    def __init__(self, cmd: list[str], env: dict, name: str):
        self.cmd, self.env, self.name = cmd, env, name
        self.launcher_died: int | None = None  # torchrun/msrun's exit code when it went before its ranks
        self.stopped_by: int | None = None
        self.stopped_count = 0
        self._done = threading.Event()

    def run(self) -> int:
        proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
        self.proc, self.watch = proc, Watch(proc.pid)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        monitor = threading.Thread(target=self._monitor, daemon=True)
        monitor.start()
        scheduler_handled = False
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                self.watch.feed(line)
                if self.watch.msrun_failed and not scheduler_handled:
                    # msrun names the failed rank, kills the others, then waits for its
                    # scheduler, which waits out the heartbeat timeout of the dead ranks (about
                    # 30 s): the job has failed already. A rank may also fail because the
                    # scheduler was killed: then the scheduler is gone already and stays the culprit.
                    scheduler_handled = True
                    self.watch.scan()
                    if SCHEDULER not in self.watch.first_deaths:
                        self.watch.scheduler_stopped = True
                        self.watch.signal_all(signal.SIGTERM, role=SCHEDULER)
            code = proc.wait()
        finally:
            self._done.set()
            monitor.join(timeout=GRACE_SECONDS + 5)
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.stopped_by is not None:
            self._reap(deadline=time.time() + GRACE_SECONDS)
        return code

    def culprit(self) -> str:
        if self.launcher_died is not None:
            return f"{self.name} itself died first (exit code {self.launcher_died}); its ranks were stopped"
        return self.watch.culprit()

    def _monitor(self) -> None:
        scheduler_lost, scheduler_gone = False, None
        while not self._done.wait(POLL_SECONDS):
            self.watch.scan()
            if (SCHEDULER in self.watch.first_deaths and not self.watch.scheduler_stopped and not scheduler_lost
                    and not self.watch.scheduler_clean and self.stopped_by is None):
                scheduler_gone = scheduler_gone or time.time()
                if time.time() - scheduler_gone >= SCHEDULER_GRACE_SECONDS:
                    # without their scheduler msrun's ranks cannot go on; left alone they would
                    # wait out its heartbeat (about 30 s) before failing
                    scheduler_lost = True
                    self.watch.signal_all(signal.SIGTERM)
                    self._reap(time.time() + GRACE_SECONDS)
            code = self.proc.poll()
            if code is not None and self.launcher_died is None and self.stopped_by is None and self.watch.alive():
                # torchrun or msrun itself is gone and its ranks are orphans (torchrun's run in
                # sessions of their own and would train on, holding our output pipe open)
                self.launcher_died = code
                self.watch.signal_all(signal.SIGTERM)
                self._reap(time.time() + GRACE_SECONDS)

    def _on_signal(self, signum, frame) -> None:
        if self.stopped_by is not None:  # a second signal: no more patience
            self.watch.signal_all(signal.SIGKILL)
            return
        self.stopped_by = signum
        self.watch.scan()
        self.stopped_count = self.watch.signal_all(signum)
        threading.Thread(target=self._reap, args=(time.time() + GRACE_SECONDS,), daemon=True).start()

    def _reap(self, deadline: float) -> None:
        """Wait for the job to leave after the forwarded signal; kill what remains at the deadline."""
        while time.time() < deadline:
            self.watch.scan()
            if not self.watch.alive():
                return
            time.sleep(0.2)
        self.watch.signal_all(signal.SIGKILL)
