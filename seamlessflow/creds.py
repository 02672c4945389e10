"""``seamlessflow creds``: identities for a run's principals (and the broker's accounts file),
route secrets for a cluster's servers, and the gateway's keys."""

import argparse

from broker.auth import IDENTITY_ENV, Identity, write_routes
from broker.permissions import Principal
from broker.server import authority as broker_authority
from broker.server import tls_files
from common.durations import parse_duration
from rollout.gateway.keys import write_run_keys
from seamlessflow.config import load_config, override
from seamlessflow.exceptions import InputError


def creds(args: argparse.Namespace) -> int:
    """Write what ``args`` asks for and say where; 0, or InputError on flags that do not fit."""
    config = load_config(args.config)
    run = args.run or config.run
    state_dir = args.state_dir or config.broker.state_dir
    valid_for = parse_duration(args.valid_for) if args.valid_for else None
    if args.valid_for and not valid_for:
        raise InputError(f"--valid-for {args.valid_for!r} is not a duration like 12h or 7d")
    if bool(args.routes) != bool(args.route):
        raise InputError("--routes FILE and --route HOST:PORT go together")
    if args.routes:
        write_routes(args.routes, args.route)
        print(f"route credentials of {len(args.route)} servers: {args.routes}")
    if args.gateway_keys:
        keys = write_run_keys(args.gateway_keys)
        print(
            f"gateway keys: {keys.keys_file} (agents: {keys.openai_key_file}, /metrics: "
            f"{keys.metrics_key_file})"
        )
    if (args.gateway_keys or args.routes) and not (args.principal or args.accounts):
        return 0
    broker = override(config, {"broker": {"state_dir": str(state_dir), "insecure": False}}).broker
    authority = broker_authority(broker, tls_files(broker))
    assert authority is not None
    principals = [Principal(x) for x in args.principal or [x.value for x in Principal]]
    for principal in principals:
        path = authority.issue(run, principal, valid_for)
        expires = Identity.load(path).expires
        print(f"{principal.value:11s} {path}" + (f" (expires {expires})" if expires else ""))
    if args.accounts:
        authority.write_accounts(args.accounts)
        print(f"accounts of runs {', '.join(authority.runs())}: {args.accounts}")
        print(
            f"connect with: {IDENTITY_ENV}=<file>; a nats-server whose config includes "
            f"{args.accounts} applies new identities at its next reload"
        )
        return 0
    conf = state_dir / "nats-server.conf"
    print(
        f"connect with: {IDENTITY_ENV}=<file> (Python processes), or the file's seed and "
        f"inbox_prefix (docs/protocol.md); a `seamlessflow broker` on {state_dir} applies new "
        f"identities within a second ({conf})"
    )
    return 0
