"""What authorization and TLS cost on the data plane's hops, in one run.

Three embedded brokers run side by side: open (``insecure``), with authorization (nkey
identities, each principal's permissions: ``broker.permissions``), and with authorization and
TLS. On each, the two kinds of hop a generation call makes:

- a JetStream publish and its ack (a generation request, a call record): the run's ``client``
  submits a task to ``sf.<run>.tasks``;
- a core request/reply (the token stream's chunks and role changes are core messages): the
  ``scheduler`` asks a ``worker`` on ``sf.<run>.ctl.role.<id>``, which answers on the
  scheduler's inbox (allowed as a response).

The variants take turns hop by hop, round after round, so noise on this shared machine falls
on all of them alike. A call through the gateway makes about three JetStream publishes and a
handful of core messages; ``per call`` estimates its added cost as 3 x the publish's added p50
+ 4 x the request's.

Usage: python -m bench.broker_security [--rounds 2000]. Prints a table and writes
bench/results/broker_security.json.
"""

import argparse
import asyncio
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

from bench.machine import machine
from bench.output import percentile, write_results
from broker.client import session
from broker.config import EmbeddedBrokerConfig, ProvisionConfig
from broker.permissions import Principal
from broker.provision import provision_run
from broker.server import EmbeddedBroker
from broker.subjects import RunNames

RUN = "bench"
VARIANTS = ("open", "auth", "auth+tls")


def _config(state: Path, variant: str) -> EmbeddedBrokerConfig:
    return EmbeddedBrokerConfig(
        state_dir=state / variant.replace("+", "_"),
        insecure=variant == "open",
        tls_generate=variant == "auth+tls",
    )


async def _clients(stack: AsyncExitStack, broker: EmbeddedBroker, variant: str):
    """(client, scheduler, worker) connections, each as its principal (or anonymous), over TLS
    when the broker speaks it; the run provisioned by its admin."""

    def who(principal: Principal) -> Path | None:
        return broker.authority.path(RUN, principal) if broker.authority else None

    conns = []
    for principal in (Principal.ADMIN, Principal.CLIENT, Principal.SCHEDULER, Principal.WORKER):
        connecting = session(
            broker.url,
            f"bench-{variant}-{principal}",
            identity_file=who(principal),
            ca_file=broker.tls.ca if broker.tls else None,
        )
        conns.append(await stack.enter_async_context(connecting))
    admin, client, scheduler, worker = conns
    await provision_run(admin.jetstream(), RUN, ProvisionConfig())
    return client, scheduler, worker


async def bench(rounds: int) -> dict:
    names = RunNames(RUN)
    times: dict[str, dict[str, list[float]]] = {v: {"publish": [], "request": []} for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        brokers = {}
        for variant in VARIANTS:
            broker = EmbeddedBroker(_config(Path(tmp), variant))
            if broker.authority:
                broker.authority.issue_run(RUN)
            brokers[variant] = broker.start()
        try:
            async with AsyncExitStack() as stack:
                hops = {}
                for variant, broker in brokers.items():
                    client, scheduler, worker = await _clients(stack, broker, variant)

                    async def answer(msg, worker=worker) -> None:
                        await worker.publish(msg.reply, b"ack")

                    await worker.subscribe(names.ctl_role("w1"), cb=answer)
                    await worker.flush()
                    hops[variant] = (client.jetstream(), scheduler)
                for i in range(rounds):
                    order = VARIANTS[i % 3 :] + VARIANTS[: i % 3]
                    for variant in order:
                        js, scheduler = hops[variant]
                        start = time.perf_counter()
                        await js.publish(names.tasks, b"{}")
                        mid = time.perf_counter()
                        await scheduler.request(names.ctl_role("w1"), b"role", timeout=5)
                        end = time.perf_counter()
                        times[variant]["publish"].append((mid - start) * 1e3)
                        times[variant]["request"].append((end - mid) * 1e3)
        finally:
            for broker in brokers.values():
                broker.stop()
    return _summary(times, rounds)


def _summary(times: dict, rounds: int) -> dict:
    summary = {
        v: {hop: {"p50": percentile(ms, 50), "p99": percentile(ms, 99)} for hop, ms in hops.items()}
        for v, hops in times.items()
    }
    added = {}
    for v in VARIANTS[1:]:
        pub = summary[v]["publish"]["p50"] - summary["open"]["publish"]["p50"]
        req = summary[v]["request"]["p50"] - summary["open"]["request"]["p50"]
        added[v] = {
            "publish_p50_ms": pub,
            "request_p50_ms": req,
            "per_call_p50_ms": 3 * pub + 4 * req,
        }
    return {"rounds": rounds, "ms": summary, "added_vs_open": added, "machine": machine()}


def print_report(result: dict) -> None:
    print(f"{'variant':10s} {'publish p50':>12s} {'p99':>8s} {'request p50':>12s} {'p99':>8s}")
    for v, hops in result["ms"].items():
        p, r = hops["publish"], hops["request"]
        print(f"{v:10s} {p['p50']:12.3f} {p['p99']:8.3f} {r['p50']:12.3f} {r['p99']:8.3f}")
    for v, a in result["added_vs_open"].items():
        print(
            f"{v}: +{a['publish_p50_ms']:.3f} ms a publish, +{a['request_p50_ms']:.3f} ms a "
            f"request, about +{a['per_call_p50_ms']:.3f} ms p50 a call (3 publishes, 4 messages)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    result = asyncio.run(bench(args.rounds))
    print_report(result)
    print(f"wrote {write_results('broker_security.json', result)}")


if __name__ == "__main__":
    main()
