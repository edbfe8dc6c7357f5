"""Start a script on several local ranks: as torchrun / msrun would (the launch helper), or through them."""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

from mindspeed_core.backends.mindspore import LAUNCH_ENV as MSRUN_ENV
from mindspeed_core.launcher import local_script_command


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel handed out (as
    port 0 does) can be handed out again, to another launch's rank connections, before this
    launch's master binds it ("address already in use", seen once in CI rehearsals)."""
    low, high = 20000, 32000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            high = min(high, int(fh.read().split()[0]))
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(100):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything tried was taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(framework: str) -> dict:
    env = dict(os.environ)
    env["MINDSPEED_AI_FRAMEWORK"] = framework
    env["OMP_NUM_THREADS"] = "1"  # several ranks share two cores
    # a rank that crashes (a signal, not an exception) leaves its Python stack in its log: a
    # MindSpore rank once died of SIGSEGV after its run with nothing else to go on
    env.setdefault("PYTHONFAULTHANDLER", "1")
    # msrun starts workers with the "python" on PATH: make it this interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env if framework == "pytorch" else {**MSRUN_ENV, **env}


def launch(framework: str, nproc: int, script: str, args: list[str], log_dir: str, timeout: int = 300,
           launcher: bool = False):
    """Run ``script`` on ``nproc`` local ranks; returns (exit code, the ranks' output).

    ``launcher``: through torchrun / msrun, as a user's own launch line runs. Otherwise the ranks
    are started here with the environment those launchers give them (torchrun's RANK /
    WORLD_SIZE / MASTER_*; MindSpore's documented dynamic-cluster variables, a scheduler process
    and the workers): the same job without the launcher's own start-up, about 4 s a launch (it
    imports its framework before starting anything). The launchers themselves are tested where
    users meet them, through `mindspeed launch`."""
    if launcher:
        return _through_launcher(framework, nproc, script, args, log_dir, timeout)
    env, port = _environment(framework), str(free_port())
    os.makedirs(log_dir, exist_ok=True)
    roles = []  # (log name, environment)
    if framework == "pytorch":
        for rank in range(nproc):
            roles.append((f"worker_{rank}", {**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                             "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                                             "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}))
    else:
        cluster = {**env, "MS_WORKER_NUM": str(nproc), "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": port,
                   "MS_TOPO_TIMEOUT": "600", "RANK_SIZE": str(nproc)}
        roles.append(("scheduler", {**cluster, "MS_ROLE": "MS_SCHED", "RANK_ID": "0"}))
        for rank in range(nproc):
            roles.append((f"worker_{rank}", {**cluster, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank),
                                             "RANK_ID": str(rank), "DEVICE_ID": str(rank)}))
    procs = []
    for name, role_env in roles:
        with open(os.path.join(log_dir, f"{name}.log"), "w") as fh:
            procs.append((name, subprocess.Popen([sys.executable, script, *args], stdout=fh, stderr=subprocess.STDOUT,
                                                 env=role_env, start_new_session=True)))
    workers = [p for name, p in procs if name != "scheduler"]
    deadline, code = time.time() + timeout, None
    while code is None:
        codes = [p.poll() for p in workers]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:  # the others would wait for it in their next collective
            code = failed[0]
        elif all(c == 0 for c in codes):
            code = 0
        elif time.time() > deadline:
            code = -1
        else:
            time.sleep(0.1)
    for name, p in procs:
        try:  # the scheduler leaves once the workers have
            p.wait(timeout=30 if code == 0 else 0.01)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    out = "".join(f"\n--- {name}.log ---\n" + pathlib.Path(log_dir, f"{name}.log").read_text(errors="replace")
                  for name, _ in procs)
    return code, out + (f"\n[timed out after {timeout}s]" if code == -1 else "")


def _through_launcher(framework: str, nproc: int, script: str, args: list[str], log_dir: str, timeout: int):
    env = _environment(framework)
    cmd, _ = local_script_command(nproc, script, args, framework, log_dir)  # the launcher's own command line
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank still in its group
        _kill_ranks(script, args)  # torchrun starts ranks in sessions of their own
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a rank we could not find still holds the pipe
            out = ""
        return -1, out + f"\n[timed out after {timeout}s]"
    logs = ""
    if os.path.isdir(log_dir):
        for name in sorted(os.listdir(log_dir)):
            with open(os.path.join(log_dir, name), errors="replace") as fh:
                logs += f"\n--- {name} ---\n" + fh.read()[-4000:]
    return proc.returncode, out + logs


def _kill_ranks(script: str, args: list[str]) -> None:
    """Kill every process running ``script`` with ``args`` (a rank left behind by its
    launcher keeps the output pipe open, and reading it would wait for ever)."""
    wanted = [script, *args]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(argv[i:i + len(wanted)] == wanted for i in range(len(argv))):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def run_configs(framework: str, nproc: int, spec: list, tmp_path: pathlib.Path, timeout: int = 900) -> pathlib.Path:
    """Train each (name, flags) of ``spec`` in turn in one launch of ``nproc`` ranks
    (parity_worker.py); returns the folder of their metrics, gradients and logs."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (tmp_path / "configs.json").write_text(json.dumps(spec))
    code, output = launch(framework, nproc, str(pathlib.Path(__file__).with_name("parity_worker.py")),
                          [str(out), str(tmp_path / "configs.json")], str(tmp_path / "logs"), timeout=timeout)
    (tmp_path / "launch.log").write_text(output)  # each case's time is in rank 0's lines "case NAME: S s"
    assert code == 0, output[-8000:]
    return out


class TwoNodes:
    """Two "nodes" on this machine: network namespaces joined by a veth pair, each with its
    own address and loopback, so a job across them meets what a job across hosts meets
    (the hostname resolves to a loopback address the other node cannot reach).
    ``nodes`` is [(namespace, interface, address)] for node 0 and node 1; needs root and
    iproute2, and says why not in ``unavailable`` otherwise."""

    SUBNET = "10.77.0"

    def __init__(self):
        tag = f"ms{os.getpid()}"
        self.nodes = [(f"{tag}a", f"{tag}a0", f"{self.SUBNET}.1"), (f"{tag}b", f"{tag}b0", f"{self.SUBNET}.2")]
        self.unavailable = None
        if os.geteuid() != 0 or shutil.which("ip") is None:
            self.unavailable = "network namespaces are not available here (they need root and iproute2's 'ip')"
            return
        (a, ia, _), (b, ib, _) = self.nodes
        steps = [["netns", "add", a], ["netns", "add", b],
                 ["link", "add", ia, "netns", a, "type", "veth", "peer", "name", ib, "netns", b]]
        for ns, interface, address in self.nodes:
            steps += [["-n", ns, "addr", "add", f"{address}/24", "dev", interface],
                      ["-n", ns, "link", "set", interface, "up"], ["-n", ns, "link", "set", "lo", "up"]]
        for step in steps:
            done = subprocess.run(["ip", *step], capture_output=True, text=True)
            if done.returncode != 0:
                self.close()
                self.unavailable = (f"network namespaces are not available here: 'ip {' '.join(step)}' said "
                                    f"{done.stderr.strip()!r}")
                return

    def run(self, commands: list[list[str]], env: dict, log_dir, timeout: float) -> list[tuple[int, str]]:
        """Run commands[k] in node k's namespace, all at once; (exit code, output) of each.
        When one fails the others get 30 s to notice before they are stopped (a node left
        waiting for a peer that is gone would otherwise sit out the whole timeout)."""
        procs, logs = [], []
        for k, argv in enumerate(commands):
            logs.append(open(os.path.join(log_dir, f"node{k}.out"), "w+"))
            procs.append(subprocess.Popen(["ip", "netns", "exec", self.nodes[k][0], *argv], stdout=logs[-1],
                                          stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline, first_failure = time.time() + timeout, None
        while None in [p.poll() for p in procs]:  # a list: every process polled each round
            if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                first_failure = time.time()
            if time.time() > deadline or (first_failure and time.time() > first_failure + 30):
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
            time.sleep(0.5)
        results = []
        for p, log in zip(procs, logs):
            log.seek(0)
            results.append((p.returncode, log.read()))
            log.close()
        return results

    def close(self) -> None:
        for ns, _, _ in self.nodes:  # deleting a namespace takes its end of the veth pair along
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
