"""Errors raised by the data plane."""

from common.exceptions import SeamlessFlowError


class BrokerError(SeamlessFlowError):
    """Something about the broker or a message on it is wrong."""


class UnavailableError(SeamlessFlowError):
    """A part the work needs (the broker, the gateway, an engine) cannot serve now. It says
    nothing about the message: an ingress handler that raises it has its message held, never
    failed nor dead-lettered, and the ingress stops taking work until the part answers again."""


class BrokerNotFoundError(BrokerError):
    """No usable ``nats-server`` binary was found."""


class BrokerUnavailableError(BrokerError, UnavailableError):
    """The NATS server at the given URL cannot be reached."""


class BrokerStartError(BrokerError):
    """The embedded ``nats-server`` did not start or did not become healthy."""


class RunNotProvisionedError(BrokerError):
    """A stream or durable consumer of the run is missing; raised only by ``broker.provision``
    (``run_stream_info``, ``durable_info``), with the one wording that says what to run."""


class ProvisionConflictError(BrokerError):
    """A run's stream, consumer or bucket exists with another configuration than asked."""


class InvalidMessageError(BrokerError):
    """A payload could not be decoded or does not match its schema; ``reason`` says why."""

    def __init__(self, reason: str, *, subject: str | None = None) -> None:
        self.reason = reason
        self.subject = subject
        super().__init__(f"{subject}: {reason}" if subject else reason)


class InvalidNameError(BrokerError):
    """A run, worker or call name cannot be used inside a subject or bucket name."""


class RetryStoppedError(UnavailableError):
    """The caller stopped while an operation was still failing for a broker outage."""


class StoppedWaitingError(RetryStoppedError):
    """A service was stopped while it still waited for its broker at start: nothing ran yet."""


class WeightsIntegrityError(BrokerError):
    """A weight blob is missing, or its size or checksum differs from its event."""


class IdentityError(BrokerError):
    """An identity file is missing, unreadable, readable by others or malformed."""


class AuthorizationError(BrokerError):
    """The broker refused the identity (unknown, another run's, or none on a secured broker)."""


class BrokerTlsError(BrokerError):
    """TLS with the broker failed: its certificate is not signed by the CA this client trusts."""
