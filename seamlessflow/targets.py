"""The Prometheus scrape targets of a run, as a ``file_sd_configs`` file.

``seamlessflow run`` knows the ``/metrics`` URL of every process it starts (from their ready
lines) and follows the worker registry (``sf-<run>-workers``), where every rollout worker and
trainer puts its ``metrics_url``, so workers that join or leave the run (started by hand with
``seamlessflow worker --run NAME``) are followed too. It writes one JSON target group per process:

    [{"targets": ["127.0.0.1:40123"],
      "labels": {"job": "seamlessflow-worker", "run": "quickstart",
                 "__metrics_path__": "/metrics"}}]

``job`` is ``seamlessflow-<command>`` (broker, worker, gateway, trajectory, trainer, agents,
scheduler) and
``run`` the run name: Prometheus attaches both to every series it scrapes there, and the shipped
dashboards filter on them. The file is replaced atomically (a temporary file, then a rename), so
Prometheus never reads half of it.
"""

import json
import logging
import os
from pathlib import Path
from urllib.parse import urlsplit

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from broker.registry import watch_workers
from broker.subjects import RunNames
from common.log import kv
from seamlessflow.exceptions import TargetError
from tagsched.spec import has_tags

log = logging.getLogger(__name__)

KINDS = ("broker", "worker", "gateway", "trajectory", "trainer", "agents", "scheduler")
"""The process kinds; each is scraped as job ``seamlessflow-<kind>``."""


def job_name(kind: str) -> str:
    if kind not in KINDS:
        raise TargetError(f"unknown process kind {kind!r}; one of {', '.join(KINDS)}")
    return f"seamlessflow-{kind}"


def target_group(metrics_url: str, kind: str, run: str) -> dict:
    """One ``file_sd`` target group for the process serving ``metrics_url``."""
    url = urlsplit(metrics_url)
    try:
        port = url.port  # ValueError for a port that is no number or out of range
    except ValueError:
        port = None
    if url.scheme != "http" or not url.hostname or not port:
        raise TargetError(f"not an http://host:port/... metrics URL: {metrics_url!r}")
    labels = {"job": job_name(kind), "run": run, "__metrics_path__": url.path or "/metrics"}
    return {"targets": [url.netloc], "labels": labels}


class ScrapeTargets:
    """The run's targets file: ``add`` the processes the run started, ``follow`` the registry;
    every change rewrites ``path``."""

    def __init__(self, path: Path, run: str) -> None:
        self.path = path
        self.run = run
        self._started: dict[str, str] = {}  # metrics URL -> kind, in start order
        self._registered: dict[str, tuple[str, str]] = {}  # worker id -> (metrics URL, kind)
        self.write()

    def add(self, metrics_url: str, kind: str) -> None:
        """A process this run started (known from its ready line)."""
        target_group(metrics_url, kind, self.run)  # refuse a bad URL or kind now
        self._started[metrics_url] = kind
        self.write()

    def groups(self) -> list[dict]:
        kinds = dict(self._started)
        for url, kind in self._registered.values():
            kinds.setdefault(url, kind)  # a started process registers too: listed once
        return [target_group(url, kind, self.run) for url, kind in kinds.items()]

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.groups(), indent=1) + "\n")
        os.replace(tmp, self.path)

    def clear(self) -> None:
        """The run is over: no targets (Prometheus marks their series stale)."""
        self._started.clear()
        self._registered.clear()
        self.write()

    async def follow(self, js: JetStreamContext, names: RunNames) -> None:
        """Track the worker registry until cancelled: a worker or trainer rank that registers a
        ``metrics_url`` becomes a target, and stops being one when its entry goes. A broken
        watch (or a targets file that cannot be written) is logged and ends the following, not
        the run."""
        try:
            await self._follow(js, names)
        except (NatsError, TimeoutError, OSError) as exc:
            log.warning(kv("scrape_targets_not_followed", error=f"{type(exc).__name__}: {exc}"))

    async def _follow(self, js: JetStreamContext, names: RunNames) -> None:
        async for worker_id, entry in watch_workers(js, names):
            before = self._registered.get(worker_id)
            if entry is None or not entry.metrics_url:
                self._registered.pop(worker_id, None)
            else:
                # by capability, not by the role of the moment: a lent trainer stays a trainer
                kind = "worker" if has_tags(entry.tags, ["rollout"]) else "trainer"
                try:
                    target_group(entry.metrics_url, kind, self.run)
                except TargetError as exc:
                    log.warning(kv("scrape_target_skipped", worker=worker_id, error=exc))
                    continue
                self._registered[worker_id] = (entry.metrics_url, kind)
            if self._registered.get(worker_id) != before:  # heartbeats change nothing here
                self.write()
