"""The scheduler's metrics (admission, assignments, role changes, lending), in one registry."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from broker.messages import Role, WeightsState

REGISTRY = CollectorRegistry()  # this part's metrics: common.metrics

ADMITTED = Counter("sf_scheduler_tasks_admitted", "Tasks admitted to the agents", registry=REGISTRY)
OUTSTANDING = Gauge(
    "sf_scheduler_admission_outstanding",
    "Outstanding groups: admitted not finished, ended sessions not yet built and untrained "
    "samples, the last two in groups",
    registry=REGISTRY,
)
LIMIT = Gauge(
    "sf_scheduler_admission_limit",
    "Outstanding groups allowed: steps_ahead * the registered trainer's groups_per_step (0 "
    "until a trainer registers, or while its shape is refused)",
    registry=REGISTRY,
)
REFUSED = Counter(
    "sf_scheduler_admission_refused",
    "Trainer shapes (its registry entry) admission refused to follow, admitting nothing: "
    "disagreeing with the scheduler's config (mismatch) or past the staleness bound (staleness)",
    ["reason"],
    registry=REGISTRY,
)
for _reason in ("mismatch", "staleness"):
    REFUSED.labels(_reason)
WAITING = Gauge(
    "sf_scheduler_admission_waiting",
    "1 while a task waits for room under the staleness bound",
    registry=REGISTRY,
)
ADMISSION_WAIT = Histogram(
    "sf_scheduler_admission_wait_seconds",
    "From a task being stored to its admission",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
    registry=REGISTRY,
)
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LEADER = Gauge(
    "sf_scheduler_leader", "1 while this scheduler holds the run's lease", registry=REGISTRY
)
ASSIGNED = Gauge(
    "sf_scheduler_workers", "Live workers by the role they hold", ["role"], registry=REGISTRY
)
WEIGHTS = Gauge(
    "sf_scheduler_workers_weights",
    "Live workers by where they stand in the weight rhythm (ready, waiting, loading), as their "
    "registry entries say",
    ["state"],
    registry=REGISTRY,
)
QUARANTINED = Gauge(
    "sf_scheduler_workers_quarantined",
    "Live workers quarantined now (a weight load overran its deadline: not serving)",
    registry=REGISTRY,
)
LENT = Gauge("sf_scheduler_workers_lent", "Trainer workers lent to rollout now", registry=REGISTRY)
FENCED = Counter("sf_scheduler_fenced", "Workers fenced for missing a deadline", registry=REGISTRY)
FENCED_NOW = Gauge("sf_scheduler_workers_fenced", "Workers fenced now", registry=REGISTRY)
CHANGES = Counter(
    "sf_scheduler_role_changes",
    "Role change requests, by outcome (acked, refused, timeout)",
    ["outcome"],
    registry=REGISTRY,
)
UNSATISFIED = Gauge(
    "sf_scheduler_unsatisfied", "1 while the live workers cannot meet the spec", registry=REGISTRY
)
LEND_SECONDS = Histogram(
    "sf_scheduler_lend_seconds",
    "From the decision to lend a trainer worker to it serving rollout",
    buckets=_SECONDS,
    registry=REGISTRY,
)
RECLAIM_SECONDS = Histogram(
    "sf_scheduler_reclaim_seconds",
    "From the decision to reclaim a lent trainer worker to the trainer holding it again",
    buckets=_SECONDS,
    registry=REGISTRY,
)
STATE_WRITES = Counter(
    "sf_scheduler_state_writes",
    "Writes of the scheduler's durable state (sf-<run>-state): claimed (taking over), written, "
    "deposed (refused: another scheduler wrote it since, so this one stops leading)",
    ["outcome"],
    registry=REGISTRY,
)
for _role in Role:
    ASSIGNED.labels(_role.value)
for _state in WeightsState:
    WEIGHTS.labels(_state.value)
for _outcome in ("claimed", "written", "deposed"):
    STATE_WRITES.labels(_outcome)
for _outcome in ("acked", "refused", "timeout"):
    CHANGES.labels(_outcome)
GROUP_SIZE = Gauge(
    "sf_scheduler_trainer_group_size",
    "Workers in the trainer group (the data-parallel ranks of the trainer)",
    registry=REGISTRY,
)
GROUP_GENERATION = Gauge(
    "sf_scheduler_trainer_group_generation",
    "Generation of the trainer group record (one more at each membership change)",
    registry=REGISTRY,
)
GROUP_CHANGES = Counter(
    "sf_scheduler_trainer_group_changes",
    "Trainer group membership changes written, by cause: a worker joined or left",
    ["cause"],
    registry=REGISTRY,
)
for _cause in ("joined", "left"):
    GROUP_CHANGES.labels(_cause)
