"""A real SLURM cluster on this host for tests: munged, slurmctld and N slurmd as nodes.

Debian's slurm-wlm 22.05 with the single-host setup of shared/platform-notes.md: every
simulated node is a slurmd with its own name and port on 127.0.0.1. Everything the cluster
writes (config, state, spool, logs, pid files) lives in one scratch directory; clients find
the config through ``SLURM_CONF``, which jobs inherit.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

from suite_budget import patient

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
# Real nodes have their own host name and /dev/shm (mosaicml-streaming coordinates a host's
# ranks through them; t2train groups data readers by host name), and resolve each other's
# names. Each slurmd, and so every job process of that node, gets its own UTS and mount
# namespaces: host name = node name, a private /dev/shm, and an /etc/hosts naming all nodes.
OWN_HOST = [
    "unshare",
    "--uts",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    'hostname "$0" && mount --bind "$1" /etc/hosts && '
    'mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && shift && exec "$@"',
]


def _installed() -> bool:
    return all(shutil.which(name) or Path("/usr/sbin", name).exists() for name in DAEMONS)


def install_reason() -> Optional[str]:
    """Install SLURM and munge with apt when missing; a reason string when impossible."""
    if _installed():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and cannot be (needs root and apt-get)"
    # Both test workers may ask at once; apt would refuse the second (dpkg's lock).
    with open("/tmp/t2train-tests-apt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed():
            return None  # the other worker installed them
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode != 0:
                return f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-500:]}"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _can_isolate_hosts() -> bool:
    return (
        subprocess.run(
            [*OWN_HOST, "probe", "/etc/hosts", "true"], capture_output=True, timeout=30
        ).returncode
        == 0
    )


def munge_works() -> bool:
    encode = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if encode.returncode != 0:
        return False
    return (
        subprocess.run(["unmunge"], input=encode.stdout, capture_output=True, timeout=10).returncode
        == 0
    )


def _free_base_port(nodes: int, first: int = 17100, step: int = 100, tries: int = 20) -> int:
    """The first base whose cluster ports are all free: the daemons of a session that was
    killed (and never stopped them) keep theirs bound, and must not fail this one."""
    for base in range(first, first + step * tries, step):
        if all(_port_free(port) for port in (base, base + 1, *range(base + 10, base + 10 + nodes))):
            return base
    raise RuntimeError(
        f"no free ports for a local SLURM cluster in {first}..{first + step * tries}"
    )


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class LocalSlurm:
    """Start with ``start()``, always ``stop()``; ``env`` is what clients need."""

    def __init__(self, root: Path, nodes: int = 2, cpus: int = 2, base_port: Optional[int] = None):
        base_port = base_port or _free_base_port(nodes)
        self.root = root
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.ports = {
            "ctld": base_port,
            "slurmd": base_port + 1,
            "nodes": (base_port + 10, base_port + 9 + nodes),
        }
        self.conf = root / "slurm.conf"
        self.hosts = root / "hosts"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._own_munged: Optional[int] = None
        self.isolated_hosts = False  # set by start(): nodes have their own hostname, /dev/shm

    def write_config(self) -> None:
        host = socket.gethostname()
        first, last = self.ports["nodes"]
        r = self.root
        for sub in ("state", "spool", "log", "run"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(f"""\
ClusterName=t2train-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ports["ctld"]}
SlurmdPort={self.ports["slurmd"]}
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
NodeName=n[1-{len(self.nodes)}] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{first}-{last}] \
CPUs={self.cpus} RealMemory=4000
PartitionName=test Nodes=n[1-{len(self.nodes)}] Default=YES MaxTime=INFINITE State=UP
""")
        self.hosts.write_text(
            Path("/etc/hosts").read_text() + f"127.0.0.1 {' '.join(self.nodes)}\n"
        )
        (r / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n"
            "ConstrainCores=no\nConstrainRAMSpace=no\n"
            "ConstrainDevices=no\nConstrainSwapSpace=no\n"
        )

    def _run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=60)

    def start(self) -> None:
        self.write_config()
        if not munge_works():
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(
                ["runuser", "-u", "munge", "--", _daemon("munged")], check=True, timeout=30
            )
            self._own_munged = int(Path("/run/munge/munged.pid").read_text())
            if not munge_works():
                raise RuntimeError("munged started but `munge -n | unmunge` fails")
        subprocess.run([_daemon("slurmctld"), "-c"], check=True, env=self.env, timeout=30)
        self.isolated_hosts = _can_isolate_hosts()
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(exist_ok=True)
            cmd = [_daemon("slurmd"), "-N", node]
            if self.isolated_hosts:
                cmd = [*OWN_HOST, node, str(self.hosts), *cmd]
            subprocess.run(cmd, check=True, env=self.env, timeout=30)
        self._wait_idle()

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + patient(timeout)
        while time.monotonic() < deadline:
            busy = self.busy_nodes()
            if not busy:
                return
            time.sleep(0.3)
        raise RuntimeError(f"nodes not idle after {timeout}s: {busy}; see {self.root}/log")

    def busy_nodes(self) -> list[str]:
        """Nodes that are not idle (a job or its ending processes run there); all of them
        while sinfo does not answer."""
        lines = self._run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
        states = dict(line.split() for line in lines if line.strip())
        return [node for node in self.nodes if states.get(node) != "idle"]

    def _pids(self) -> list[int]:
        files = [self.root / "run" / f"slurmd-{n}.pid" for n in self.nodes]
        files.append(self.root / "run" / "slurmctld.pid")
        return [int(f.read_text()) for f in files if f.is_file()]

    def stop(self) -> None:
        """Cancel jobs and let slurmd end them, then end the daemons this cluster started."""
        self._run("scancel", "--user", "root")
        deadline = time.monotonic() + patient(60)
        while self._run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        pids = self._pids()
        if self._own_munged:
            pids.append(self._own_munged)
        for pid in pids:
            _terminate(pid)

    # --- jobs --------------------------------------------------------------------------
    def sbatch(self, *args: str, env: dict) -> str:
        proc = subprocess.run(
            ["sbatch", "--parsable", *args],
            capture_output=True,
            text=True,
            env=dict(self.env, **env),
            timeout=60,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed: {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict ({} once the job is gone).

        A busy slurmctld can time out a query; that is retried, never read as "job gone".
        """
        for _ in range(20):
            proc = self._run("scontrol", "show", "job", "--oneliner", job_id)
            if proc.returncode == 0 or "Invalid job id" in proc.stderr:
                break
            time.sleep(1)
        else:
            raise RuntimeError(f"scontrol show job {job_id} keeps failing: {proc.stderr}")
        fields = {}
        for item in proc.stdout.split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def wait_job(self, job_id: str, until, timeout: float, log: Optional[Path] = None) -> dict:
        """Poll until ``until(job_fields)`` holds; fail with the job's log on timeout."""
        deadline = time.monotonic() + patient(timeout)
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if until(fields):
                return fields
            time.sleep(0.5)
        tail = log.read_text()[-6000:] if log and log.is_file() else "(no log)"
        raise AssertionError(f"job {job_id} not done in {timeout}s: {self.job(job_id)}\n{tail}")


def _alive(pid: int) -> bool:
    """Running, not a zombie (daemons are reparented to an init that may not reap them)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _terminate(pid: int, timeout: float = 15) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + patient(timeout)
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
