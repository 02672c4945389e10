"""Nodes on one machine, for tests and benchmarks: ``Cluster(n)`` makes ``n`` Linux namespaces
that each look like a host of its own, joined only by a network bridge.

Node ``i`` (``sfn<i>``, hostname ``sfn-node<i>``, address ``<subnet>.<11+i>``) has

- a network namespace (``ip netns``): lo, and eth0 on a veth pair whose other end is on the
  bridge ``sfnbr0`` (``<subnet>.1``, this machine's side); its only route is the subnet, so a
  node reaches the other nodes and the bridge address, nothing else;
- a UTS namespace: its own hostname, which every node resolves to its address (one hosts file
  for the cluster, bound over each node's ``/etc/hosts``, as a cluster's DNS would);
- a mount namespace (private propagation): a tmpfs of its own on ``/dev/shm`` (where the trainer
  writes host-local weight copies, ``trainer.config._memory_folder``), its own state folder
  mounted over ``~/.local/state`` (``common.paths.default_state_dir``: ``SEAMLESSFLOW_STATE_DIR``
  and ``XDG_STATE_HOME`` are unset in nodes), its own boot id over
  ``/proc/sys/kernel/random/boot_id`` (so ``broker.weights.host_id()`` differs in hostname and
  boot), its netns's sysfs, and an empty tmpfs over the cluster's base folder, so no node sees
  another's state. The rest of the file system (code, venv, models, a test's tmp_path) is the
  machine's, shared.

The UTS and mount namespaces are persistent (bind-mounted under ``/run/seamlessflow-nodes``, a
private mount), so every process ``Node.run`` starts (``nsenter``) joins the same node.
``Node.link_down``/``link_up`` cut and restore its cable (the bridge side of its veth);
``Cluster.add`` makes one more node while the cluster runs (a node joining mid-run).

Needs root, iproute2 and util-linux (``unshare``, ``nsenter``); ``NodesUnavailable`` otherwise.
Clusters on one machine take turns (a lock). Leftovers of a killed run (the namespaces, the
processes in them, links, mounts) are removed when the next cluster starts, and by
``python -m tests.nodes --cleanup``.
"""

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from broker.server import die_with_parent

PREFIX = "sfn"
BRIDGE = f"{PREFIX}br0"
SUBNET = "10.231.19"
"""The first three octets of the nodes' /24 (the bridge is .1, node i is .11+i)."""
RUN_DIR = Path("/run/seamlessflow-nodes")
LOCK = Path("/run/seamlessflow-nodes.lock")
STATE_IN_NODE = Path.home() / ".local" / "state"
"""Where a node sees its own state folder (``default_state_dir()`` is its ``seamlessflow``)."""
_HIDDEN_ENV = ("SEAMLESSFLOW_STATE_DIR", "XDG_STATE_HOME")
TOOLS = ("ip", "unshare", "nsenter", "mount", "umount")
MAX_NODES = 200


class NodesUnavailable(RuntimeError):
    """This machine cannot make nodes (not root, or a tool missing)."""


def _sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def available() -> str | None:
    """Why nodes cannot be made here, or None when they can."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "nodes need Linux and root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    return f"nodes need {', '.join(missing)} (iproute2, util-linux)" if missing else None


class Node:
    """One node of a ``Cluster``: its namespaces, address, hostname and state folder."""

    def __init__(self, index: int, base: Path, subnet: str) -> None:
        self.index = index
        self.name = f"{PREFIX}{index}"
        self.hostname = f"{PREFIX}-node{index}"
        self.address = f"{subnet}.{11 + index}"
        self.folder = base / self.name
        self.state_dir = self.folder / "state"
        """Its state folder as this machine sees it (the node sees it at ``STATE_IN_NODE``)."""
        self.netns = Path("/run/netns") / self.name
        self.uts = RUN_DIR / f"{self.name}.uts"
        self.mnt = RUN_DIR / f"{self.name}.mnt"
        self.cable = f"{self.name}h"
        """The bridge side of its veth pair."""
        self.procs: list[subprocess.Popen] = []

    def command(self, argv: Sequence[str], cwd: Path | str | None = None) -> list[str]:
        """``argv`` run inside this node (in ``cwd``, default this process's)."""
        return [
            "nsenter",
            f"--net={self.netns}",
            f"--uts={self.uts}",
            f"--mount={self.mnt}",
            f"--wd={cwd or os.getcwd()}",
            "--",
            *map(str, argv),
        ]

    def environ(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment without its state folders, plus ``env``."""
        base = {k: v for k, v in os.environ.items() if k not in _HIDDEN_ENV}
        return {**base, **(env or {})}

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        cwd: Path | str | None = None,
        **popen,
    ) -> subprocess.Popen:
        """Start ``argv`` in this node (``popen``: ``subprocess.Popen``'s keywords). It dies with
        the thread that started it (``die_with_parent``) unless ``preexec_fn`` says otherwise;
        the cluster stops it at the latest when it closes."""
        popen.setdefault("preexec_fn", die_with_parent)
        popen.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self.command(argv, cwd), env=self.environ(env), **popen)
        self.procs.append(proc)
        return proc

    def exec(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 60.0
    ) -> str:
        """Run ``argv`` in this node to its end and return its stdout; raise if it fails."""
        done = subprocess.run(
            self.command(argv),
            env=self.environ(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: {argv} failed ({done.returncode}):\n{done.stderr}")
        return done.stdout

    def link_down(self) -> None:
        """Cut this node off the network (its packets and the ones to it are lost)."""
        _sh("ip", "link", "set", self.cable, "down")

    def link_up(self) -> None:
        _sh("ip", "link", "set", self.cable, "up")

    def _create(self, bridge: str, subnet: str, hosts: Path) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        boot_id = self.folder / "boot_id"
        boot_id.write_text(f"{uuid.uuid4()}\n")
        _sh("ip", "netns", "add", self.name)
        _sh(
            "ip",
            "link",
            "add",
            self.cable,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            self.name,
        )
        _sh("ip", "link", "set", self.cable, "master", bridge, "up")
        _disable_ipv6(self.cable)
        self.uts.touch()
        self.mnt.touch()
        _sh(
            "unshare",
            f"--uts={self.uts}",
            f"--mount={self.mnt}",
            "--propagation",
            "private",
            "true",
        )
        setup = [
            f"hostname {self.hostname}",
            "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6",
            "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6",
            "ip link set lo up",
            f"ip addr add {self.address}/24 dev eth0",
            "ip link set eth0 up",
            "mount -t tmpfs -o size=1g,mode=1777 sfn-shm /dev/shm",
            f"mount --bind {self.state_dir} {STATE_IN_NODE}",
            f"mount --bind {boot_id} /proc/sys/kernel/random/boot_id",
            f"mount --bind {hosts} /etc/hosts",
            "mount -t sysfs sfn-sys /sys",
            f"mount -t tmpfs -o size=1m,mode=755 sfn-hide {self.folder.parent}",
        ]
        done = subprocess.run(
            self.command(["sh", "-ec", "\n".join(setup)], cwd="/"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: setup failed: {done.stderr.strip()}")

    def _stop(self, timeout: float = 10.0) -> None:
        """SIGTERM what ``run`` started, SIGKILL what is left after ``timeout`` in all."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Cluster:
    """``n`` nodes (see the module docstring); a context manager. ``base``: the folder for the
    nodes' state (``base/sfn<i>/state``, kept after close); default a temporary one, removed."""

    def __init__(self, n: int, base: Path | None = None, *, subnet: str = SUBNET) -> None:
        if not 1 <= n <= MAX_NODES:
            raise ValueError(f"1 to {MAX_NODES} nodes, not {n}")
        self.subnet = subnet
        self.host_address = f"{subnet}.1"
        """This machine's address on the bridge (the test process talks to nodes from it)."""
        self._own_base = base is None
        self.base = Path(base or tempfile.mkdtemp(prefix="sfnodes-"))
        self.nodes = [Node(i, self.base, subnet) for i in range(n)]
        self._lock: IO | None = None

    def __enter__(self) -> "Cluster":
        if reason := available():
            raise NodesUnavailable(reason)
        self._lock = _take_lock()
        try:
            cleanup()
            _private_run_dir()
            STATE_IN_NODE.mkdir(parents=True, exist_ok=True)
            _sh("ip", "link", "add", BRIDGE, "type", "bridge")
            _disable_ipv6(BRIDGE)
            _sh("ip", "addr", "add", f"{self.host_address}/24", "dev", BRIDGE)
            _sh("ip", "link", "set", BRIDGE, "up")
            self._write_hosts()
            for node in self.nodes:
                node._create(BRIDGE, self.subnet, self.hosts)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process started in the nodes, remove the nodes; idempotent."""
        try:
            for node in self.nodes:
                node._stop()
            cleanup()
        finally:
            if self._own_base:
                shutil.rmtree(self.base, ignore_errors=True)
            if self._lock is not None:
                self._lock.close()  # releases the flock
                self._lock = None

    def add(self) -> Node:
        """A new node on the running cluster (one that joins mid-run): the next index, made
        like the first ones; removed with them."""
        if len(self.nodes) >= MAX_NODES:
            raise ValueError(f"{MAX_NODES} nodes at most")
        node = Node(len(self.nodes), self.base, self.subnet)
        self.nodes.append(node)  # (closed with the others, also if making it fails)
        self._write_hosts()
        node._create(BRIDGE, self.subnet, self.hosts)
        return node

    @property
    def hosts(self) -> Path:
        return self.base / "hosts"

    def _write_hosts(self) -> None:
        """Every node's hostname and address, rewritten in place (the nodes bind this file)."""
        lines = ["127.0.0.1 localhost", *(f"{n.address} {n.hostname}" for n in self.nodes)]
        self.hosts.parent.mkdir(parents=True, exist_ok=True)
        with self.hosts.open("a+") as hosts:  # the same inode: nodes made already see it
            hosts.seek(0)
            hosts.truncate()
            hosts.write("\n".join(lines) + "\n")

    def __getitem__(self, index: int) -> Node:
        return self.nodes[index]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)


def _take_lock(timeout: float = 300.0) -> IO:
    """One cluster at a time on this machine (so cleanup never removes a live one's nodes)."""
    handle = LOCK.open("a")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                raise NodesUnavailable(f"another cluster held {LOCK} for {timeout:g}s") from None
            time.sleep(0.05)  # often: another cluster may take it again soon after freeing it


def _private_run_dir() -> None:
    """Persistent mount namespaces must be bound on a mount with private propagation."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(RUN_DIR):
        _sh("mount", "--bind", str(RUN_DIR), str(RUN_DIR))
    _sh("mount", "--make-private", str(RUN_DIR))


def _disable_ipv6(link: str) -> None:
    """No IPv6 (router solicitations, link-local chatter) on the links made here."""
    with contextlib.suppress(OSError):
        Path(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6").write_text("1")


def _our_netns() -> list[str]:
    listing = _sh("ip", "netns", "list", check=False).stdout.split()
    return [name for name in listing if name.startswith(PREFIX) and name[len(PREFIX) :].isdigit()]


def _kill_netns_pids(name: str, timeout: float = 10.0) -> None:
    """SIGKILL the processes left in namespace ``name`` (started in it by a cluster) and wait,
    at most ``timeout`` seconds, for them to go."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p) for p in _sh("ip", "netns", "pids", name, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def cleanup() -> None:
    """Remove every node and the bridge, also a killed run's: the processes in the nodes, the
    namespaces, their links and mounts. Idempotent; call with the lock held or no cluster up."""
    for name in _our_netns():
        _kill_netns_pids(name)
        _sh("ip", "link", "del", f"{name}h", check=False)
        _sh("ip", "netns", "del", name, check=False)
    if RUN_DIR.is_dir():
        for path in RUN_DIR.glob(f"{PREFIX}*"):
            _sh("umount", str(path), check=False)
            path.unlink(missing_ok=True)
        if os.path.ismount(RUN_DIR):
            _sh("umount", str(RUN_DIR), check=False)
    for base in Path(tempfile.gettempdir()).glob("sfnodes-*"):  # default bases of killed runs
        shutil.rmtree(base, ignore_errors=True)
    for link in Path("/sys/class/net").glob(f"{PREFIX}*"):  # cables whose node is gone, bridge
        if link.name == BRIDGE or link.name[len(PREFIX) : -1].isdigit():
            _sh("ip", "link", "del", link.name, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cleanup", action="store_true", help="remove leftover nodes and exit")
    args = parser.parse_args()
    if args.cleanup:
        if reason := available():
            sys.exit(reason)
        with _take_lock():  # closing the file releases the lock
            cleanup()


if __name__ == "__main__":
    main()
