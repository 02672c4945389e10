"""A real Slurm on the namespace nodes of ``tests.nodes``: Debian's ``slurmctld`` in the first
node, one ``slurmd`` in every node (``NodeName`` its hostname, ``NodeAddr`` its address) and a
``munged`` for authentication, all from one generated ``slurm.conf``.

Everything lives in ``folder`` (a test's tmp_path, which the nodes see): the munge key and
socket (``AuthInfo=socket=...``: nothing under /run/munge or /etc/slurm is touched), the
controller's ``StateSaveLocation``, each slurmd's spool folder, pid and log (``%n``: per node).
No cgroups: ``proctrack/linuxproc``, ``task/none``, no accounting. Node names resolve in the
nodes through an ``/etc/hosts`` of the cluster bind-mounted in each node's mount namespace (as
a site's DNS would), so scripts may use host names.

The test process talks to the controller at the first node's address through the bridge:
``SlurmCluster.env`` (``SLURM_CONF``) for ``sbatch``, ``squeue``, ``scancel``, ``sinfo``.
``close`` cancels every job, waits for the nodes to be empty of job processes, stops the
daemons (theirs are the cluster's processes: ``Cluster.close`` kills what is left) and removes
the spool. Should this process be killed, the daemons die with it (``die_with_parent``) and
what the jobs left in the nodes goes with the nodes (``tests.nodes.cleanup``). Needs Debian's
``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (``apt-get install slurmctld slurmd
slurm-client munge``, Slurm 22.05 in bookworm).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from broker.server import die_with_parent
from tests.nodes import Cluster, Node
from tests.nodes import available as nodes_available

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scancel", "sinfo", "scontrol")
CPUS_PER_NODE = 8
"""What each node claims (``SlurmdParameters=config_overrides``: more than the machine has)."""
PARTITION = "sfn"


def available() -> str | None:
    """Why Slurm cannot run on nodes here, or None."""
    if reason := nodes_available():
        return reason
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        install = "apt-get install slurmctld slurmd slurm-client munge"
        return f"Slurm needs {', '.join(missing)} ({install})"
    return None


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """Slurm on ``cluster``'s nodes (a context manager); its files under ``folder``.
    ``partitions``: node kinds, ``{name: [node index, ...]}``, each a partition whose nodes
    carry its name as a feature (``--constraint``); default one partition ``PARTITION`` of
    every node, the default partition is always the first."""

    def __init__(
        self,
        cluster: Cluster,
        folder: Path,
        *,
        kill_wait_s: int = 20,
        partitions: dict[str, list[int]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.folder = folder
        self.kill_wait_s = kill_wait_s
        self.partitions = partitions or {PARTITION: list(range(len(cluster)))}
        self.conf = folder / "slurm.conf"
        self.controller = cluster[0]
        self._munged: subprocess.Popen | None = None
        self._daemons: list[tuple[Node, subprocess.Popen]] = []

    @property
    def env(self) -> dict[str, str]:
        """This process's environment for the Slurm commands (``SLURM_CONF``)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- start ----------------------------------------------------------------------------

    def __enter__(self) -> "SlurmCluster":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for sub in ("munge", "ctld", "spool", "log"):
            (self.folder / sub).mkdir(exist_ok=True, mode=0o700)
        self._hosts()
        self._start_munge()
        self.conf.write_text(self.slurm_conf())
        env = {"SLURM_CONF": str(self.conf)}
        ctld = self.controller.run(
            ["slurmctld", "-D", "-c", "-i"],
            env,
            stdout=(self.folder / "log" / "slurmctld.out").open("ab"),
            stderr=subprocess.STDOUT,
        )
        self._daemons.append((self.controller, ctld))
        self.wait(lambda: self._ping(), 30, "slurmctld answering")
        for node in self.cluster:
            out = (self.folder / "log" / f"slurmd-{node.hostname}.out").open("ab")
            proc = node.run(
                ["slurmd", "-D", "-N", node.hostname], env, stdout=out, stderr=subprocess.STDOUT
            )
            self._daemons.append((node, proc))
        self.wait(self._all_idle, 60, "every node idle in sinfo")

    def _hosts(self) -> None:
        """The nodes' names in an /etc/hosts of the cluster, bound over each node's."""
        lines = ["127.0.0.1 localhost"]
        lines += [f"{n.address} {n.hostname}" for n in self.cluster]
        hosts = self.folder / "hosts"
        hosts.write_text("\n".join(lines) + "\n")
        for node in self.cluster:
            node.exec(["mount", "--bind", str(hosts), "/etc/hosts"])
            # slurmd 22.05 always loads a cgroup plugin, which wants a cgroup mount point (a
            # node's own sysfs has none): a tmpfs there with the named systemd hierarchy (read
            # only) passes for cgroup v1; nothing uses it (proctrack/linuxproc, task/none).
            node.exec(["mount", "-t", "tmpfs", "-o", "size=1m", "sfn-cgroup", "/sys/fs/cgroup"])
            node.exec(["mkdir", "/sys/fs/cgroup/systemd"])
            node.exec(["mount", "-t", "cgroup", "-o", "ro,none,name=systemd", "sfn-cgroup-systemd",
                       "/sys/fs/cgroup/systemd"])  # fmt: skip
            (self.folder / "spool" / node.hostname).mkdir(exist_ok=True)

    def _start_munge(self) -> None:
        munge = self.folder / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._munged = subprocess.Popen(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=(munge / "munged.out").open("ab"),
            preexec_fn=die_with_parent,  # gone with this process, even if it is killed
        )
        self.wait(self.socket.exists, 15, "the munge socket")

    @property
    def socket(self) -> Path:
        return self.folder / "munge" / "munge.socket"

    def slurm_conf(self) -> str:
        f = self.folder
        ctld = self.controller
        lines = [
            "ClusterName=sfn",
            f"SlurmctldHost={ctld.hostname}({ctld.address})",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={f / 'ctld'}",
            f"SlurmdSpoolDir={f / 'spool'}/%n",
            f"SlurmctldPidFile={f / 'ctld' / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'log'}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SlurmctldTimeout=30",
            # Slurm's default: a node whose slurmd did not answer for this long is DOWN and its
            # jobs cancelled. At 60 s the test's 30 s link cut ended the job when the last ping
            # answered came 30 s before the cut.
            "SlurmdTimeout=300",
            "MessageTimeout=20",
            "InactiveLimit=0",
            "MinJobAge=300",
            f"KillWait={self.kill_wait_s}",
            "UnkillableStepTimeout=120",
        ]
        features = {i: name for name, nodes in self.partitions.items() for i in nodes}
        for node in self.cluster:
            lines.append(
                f"NodeName={node.hostname} NodeAddr={node.address} NodeHostname={node.hostname} "
                f"CPUs={CPUS_PER_NODE} RealMemory=4000 Features={features[node.index]} "
                "State=UNKNOWN"
            )
        for n, (name, nodes) in enumerate(self.partitions.items()):
            hosts = ",".join(self.cluster[i].hostname for i in nodes)
            default = "YES" if n == 0 else "NO"
            lines.append(
                f"PartitionName={name} Nodes={hosts} Default={default} MaxTime=INFINITE State=UP"
            )
        return "\n".join(lines) + "\n"

    # -- use ------------------------------------------------------------------------------

    def command(self, *argv: str, timeout: float = 30.0, check: bool = True) -> str:
        """A Slurm client command (``sinfo``, ``squeue``, ...) from this process; its stdout."""
        done = subprocess.run(
            argv,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode:
            raise SlurmError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, script: str, *args: str, cwd: Path | None = None) -> str:
        """Submit ``script``; the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *args],
            input=script,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
            cwd=cwd,
        )
        if done.returncode:
            raise SlurmError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job_state(self, job: str) -> str | None:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``CANCELLED``...), None once
        slurmctld forgot it."""
        out = self.command("scontrol", "-o", "show", "job", job, check=False)
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return None

    def steps(self, job: str) -> list[str]:
        """The job's running steps (``<job>.<step>`` ids)."""
        out = self.command("squeue", "-h", "-s", "-j", job, "-o", "%i", check=False)
        return out.split()

    def _ping(self) -> bool:
        done = subprocess.run(
            ["scontrol", "ping"], env=self.env, capture_output=True, text=True, timeout=20
        )
        self._check_daemons()
        return "UP" in done.stdout

    def _all_idle(self) -> bool:
        self._check_daemons()
        out = self.command("sinfo", "-h", "-N", "-o", "%N %t")
        states = dict(line.split() for line in out.splitlines())
        return len(states) == len(self.cluster) and all(s == "idle" for s in states.values())

    def _check_daemons(self) -> None:
        for node, proc in self._daemons:
            if proc.poll() is not None:
                raise SlurmError(
                    f"{proc.args[-3:]} on {node.name} exited ({proc.returncode}):\n{self.logs()}"
                )

    def logs(self, tail: int = 3000) -> str:
        """The daemons' logs' ends (for a failure's message)."""
        parts = []
        for path in [*sorted((self.folder / "log").glob("*")), self.folder / "munge/munged.log"]:
            if path.is_file():
                parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def wait(self, ready, timeout: float, what: str, every: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise SlurmError(f"no {what} after {timeout:g} s\n{self.logs()}")
            time.sleep(every)

    def node_pids(self, node: Node) -> list[int]:
        """The processes in ``node``'s network namespace but the Slurm daemons."""
        out = subprocess.run(
            ["ip", "netns", "pids", node.name], capture_output=True, text=True, timeout=10
        ).stdout
        daemons = {proc.pid for _, proc in self._daemons}
        pids = []
        for pid in map(int, out.split()):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if pid not in daemons and comm not in ("slurmd", "slurmctld", "slurmscriptd"):
                pids.append(pid)
        return pids

    def job_processes(self) -> dict[str, list[str]]:
        """Per node, the command lines of what runs there but the daemons."""
        found = {}
        for node in self.cluster:
            cmds = []
            for pid in self.node_pids(node):
                with contextlib.suppress(OSError):
                    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                    cmds.append(raw.replace(b"\0", b" ").decode(errors="replace").strip())
            if cmds:
                found[node.hostname] = cmds
        return found

    # -- stop -----------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel every job, stop the daemons and munged, remove the spool; idempotent."""
        if any(proc.poll() is None for _, proc in self._daemons):
            with contextlib.suppress(Exception):
                for partition in self.partitions:
                    self.command("scancel", "--full", f"--partition={partition}", check=False)
                deadline = time.monotonic() + self.kill_wait_s + 15
                while time.monotonic() < deadline and any(self.node_pids(n) for n in self.cluster):
                    time.sleep(0.5)
        for _, proc in reversed(self._daemons):  # the slurmds first, then slurmctld
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self._daemons):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._daemons.clear()
        for node in self.cluster:  # job processes a slurmd left: the node's own cleanup
            for pid in self.node_pids(node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self._munged is not None:
            self._munged.terminate()
            try:
                self._munged.wait(10)
            except subprocess.TimeoutExpired:
                self._munged.kill()
                self._munged.wait()
            self._munged = None
        for sub in ("spool", "ctld", "munge"):
            shutil.rmtree(self.folder / sub, ignore_errors=True)
