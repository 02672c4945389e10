"""Errors raised by the rollout side: engines, workers, the gateway and the agent runner (whose
own errors, in ``rollout.agents.exceptions``, derive from ``RolloutError`` too)."""

from common.exceptions import SeamlessFlowError


class RolloutError(SeamlessFlowError):
    """Something in rollout failed."""


class EngineError(RolloutError):
    """An engine failed to start, generate or load weights."""


class InvalidRequestError(RolloutError):
    """A request to the gateway is malformed or asks for something not supported.

    ``param`` names the offending field (dotted path) when there is one; ``code`` is a stable
    machine-readable reason when there is one.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthError(InvalidRequestError):
    """The prompt plus the tokens asked for do not fit the model's context."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelNotFoundError(RolloutError):
    """A request names a model the gateway does not serve."""

    code = "model_not_found"


class GenerationUnavailableError(RolloutError):
    """A call cannot be served now: the broker is unreachable, no rollout worker took it, or it
    was interrupted more often than allowed."""


class RecordUnavailableError(GenerationUnavailableError):
    """A finished call's record could not be stored, so its response is withheld."""


class GenerationFailedError(RolloutError):
    """A rollout worker reported an error while generating."""


class ClientDisconnectedError(RolloutError):
    """The client went away before its response was ready."""


class PermissionDeniedError(RolloutError):
    """A valid key used outside its rights (a tenant's key on another tenant's session)."""

    code = "permission_denied"
