"""What a Slurm job's script sets up before its parts start, the same for every job.

- ``credentials``: the run's identities, the servers' accounts and the gateway's keys, in the
  job's folder; ``as_principal`` runs a command as one identity.
- ``stopper``: the ordered stop at SIGTERM.
- ``supervisor``: the script that restarts a part that exits.

``seamlessflow.slurm`` renders the rest: nodes, NATS, the parts' steps."""

from broker.auth import IDENTITIES_ENV, IDENTITY_ENV
from broker.permissions import Principal
from seamlessflow.config import RunConfig

REPORT_S = 60
"""At SIGTERM the script gives ``seamlessflow report`` this long, then stops the parts."""
ACCOUNTS_FILE = "accounts.conf"
"""The NATS servers' accounts (``seamlessflow creds --accounts``), in the job's folder beside the
``nats.conf`` that includes it."""
KEYS = {"keys_file": "gateway_keys.toml", "agents": "agents.key", "metrics": "metrics.key"}
"""The gateway's keys (``seamlessflow creds --gateway-keys``: ``write_run_keys``' names), in
the job's folder."""


def secure(config: RunConfig) -> bool:
    """Whether the job's NATS has authorization on (each part connects as its principal): all
    but a config with ``[broker] insecure``."""
    return not config.broker.insecure


def identity(config: RunConfig, principal: Principal) -> str:
    """The identity file of ``principal`` in the job's folder, as a bash word."""
    return f'"$SF_JOB_DIR/auth/{config.run}/{principal.value}.toml"'


def as_principal(config: RunConfig, principal: Principal, command: str) -> str:
    """``command`` (bash) connecting to NATS as ``principal``; as is without authorization."""
    if not secure(config):
        return command
    return f"export {IDENTITY_ENV}={identity(config, principal)}; {command}"


def own_keys(config: RunConfig) -> bool:
    """Whether the job makes the gateway's keys (the config names no keys file of its own)."""
    return config.gateway.keys_file is None


def credentials(config: RunConfig) -> str:
    """Before NATS starts, on the job's folder (shared by the nodes): the run's identities
    (``auth/<run>/<principal>.toml``, 0600), the servers' accounts (``accounts.conf``, public
    keys only) and the gateway's keys (0600): it listens on every address, so it takes keys
    even without authorization on NATS."""
    # not the submitting shell's identity (sbatch passes its environment on): each part's own
    lines = [f"unset {IDENTITY_ENV} {IDENTITIES_ENV}"]
    args = []
    if secure(config):
        args += ['--state-dir "$SF_JOB_DIR"', f'--accounts "$SF_JOB_DIR/{ACCOUNTS_FILE}"']
    if own_keys(config):
        args.append('--gateway-keys "$SF_JOB_DIR"')
    if args:
        what = ["NATS identities (auth/), accounts"] * secure(config)
        what += ["gateway keys"] * own_keys(config)
        lines.append(f"# In the job's folder, before NATS starts: the run's {', '.join(what)}.")
        lines.append(f'{sf("creds", *args)} > "$SF_JOB_DIR/creds.log"')
    return "\n".join(lines) + "\n"


def stopper(config: RunConfig) -> str:
    """The ordered stop, set up before the first step starts."""
    lines = [
        "# The background steps' sruns: NATS_PIDS the NATS servers', PART_PIDS the parts'.",
        "NATS_PIDS=() PART_PIDS=()",
        "# SIGTERM to this script (the time limit's --signal, `scancel --batch --signal=TERM`):",
        "# SIGTERM to the parts' steps first, to the NATS steps once they are gone, so their last",
        "# acks and publishes reach NATS. (Not a signal to srun: srun kills its step at SIGTERM.)",
        "job_ids() {  # this job's ids: a heterogeneous job's steps are under each component's",
        '  if [ -z "${SLURM_HET_SIZE:-}" ]; then echo "$SLURM_JOB_ID"; return; fi',
        "  local n var ids=()",
        "  for ((n = 0; n < SLURM_HET_SIZE; n++)); do",
        '    var="SLURM_JOB_ID_HET_GROUP_$n"; ids+=("${!var}")',
        "  done",
        '  (IFS=,; echo "${ids[*]}")',
        "}",
        "signal_steps() {  # SIGTERM to this job's steps whose name starts with $1",
        "  local ids",
        '  ids=$(squeue -h -s -j "$(job_ids)" -o "%i %j" | awk -v p="$1" \'index($2, p) == 1 '
        "{print $1}') || true",
        '  [ -z "$ids" ] || echo "SIGTERM to steps" $ids >&2',
        "  # (Slurm 22.05's scancel signals a step, then reports 'Invalid job id': not shown)",
        '  [ -z "$ids" ] || scancel --signal=TERM $ids 2>/dev/null || true',
        "}",
        "stop() {",
        "  trap '' TERM INT",
        "  # The run report (summary.json: reward curve, which node ran what) while all is up.",
        f"  {_report_identity(config)}timeout {REPORT_S} seamlessflow report --config "
        '"$SF_CONFIG" --targets '
        '"$SF_JOB_DIR/scrape_targets.json" \\',
        '    --started "$SF_STARTED" --stopped-by "SIGTERM to the job" "$SF_JOB_DIR" \\',
        '    > "$SF_JOB_DIR/report.log" 2>&1 || echo "no run report: see report.log" >&2',
        '  echo "stopping: the parts, then NATS" >&2',
        "  signal_steps sf-",
        '  if [ "${#PART_PIDS[@]}" -gt 0 ]; then wait "${PART_PIDS[@]}" 2>/dev/null || true; fi',
        "  signal_steps nats-",
        "  wait || true",
        '  echo "stopped" >&2',
        "  exit 0",
        "}",
        "trap stop TERM INT",
    ]
    return "\n".join(lines) + "\n"


def _report_identity(config: RunConfig) -> str:
    if not secure(config):
        return ""
    return f"{IDENTITY_ENV}={identity(config, Principal.ADMIN)} "


def supervisor(config: RunConfig) -> str:
    """``$SF_JOB_DIR/supervise.sh CMD...``: CMD restarted when it fails, up to ``[supervise]
    max_restarts`` times in a row, ``backoff_s`` apart. At SIGTERM (its step signalled) it
    passes the signal on, waits for CMD and exits with CMD's status: a part that stops cleanly
    ends its step cleanly, and is not restarted."""
    s = config.supervise
    body = (
        "child= stopping=0\n"
        'trap \'stopping=1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null\' TERM INT\n'
        "n=0\n"
        "while :; do\n"
        '  "$@" &\n'
        "  child=$!\n"
        '  wait "$child" || true\n'
        '  while kill -0 "$child" 2>/dev/null; do wait "$child" || true; done\n'
        '  status=0; wait "$child" || status=$?\n'
        '  if [ "$status" -eq 0 ] || [ "$stopping" -eq 1 ]; then exit "$status"; fi\n'
        "  n=$((n + 1))\n"
        f'  if [ "$n" -gt {s.max_restarts} ]; then echo "$1 $2: gave up after '
        f'{s.max_restarts} restarts" >&2; exit 1; fi\n'
        f'  echo "$1 $2 exited: restart $n in {s.backoff_s} s" >&2\n'
        f"  sleep {s.backoff_s} & wait $! || true\n"
        '  if [ "$stopping" -eq 1 ]; then exit "$status"; fi\n'
        "done\n"
    )
    return f"cat > \"$SF_JOB_DIR/supervise.sh\" <<'SUPERVISE_EOF'\n{body}SUPERVISE_EOF\n"


def supervised(command: str) -> str:
    return f'exec bash "$SF_JOB_DIR/supervise.sh" {command}'


def sf(command: str, *args: str) -> str:
    """A ``seamlessflow`` command line in bash (``args`` already bash words)."""
    return " ".join(("seamlessflow", command, '--config "$SF_CONFIG"', *args))
