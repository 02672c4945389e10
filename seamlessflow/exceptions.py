"""The errors of the command line and the local launcher, all under ``LauncherError``."""

from common.exceptions import SeamlessFlowError


class LauncherError(SeamlessFlowError):
    """The root of the errors raised by ``seamlessflow`` itself (not by a part it runs)."""


class ConfigError(LauncherError):
    """A configuration file is missing, unreadable or invalid."""


class ServiceProcessError(LauncherError):
    """A service process did not start or did not stop in time."""


class RunFailedError(LauncherError):
    """A process of the run kept failing or the run could not start."""


class PlacementError(LauncherError):
    """The configured CPU sets do not fit this machine."""


class TargetError(LauncherError):
    """A scrape target that is not a process kind and ``http://host:port/...`` metrics URL."""


class InputError(LauncherError):
    """A file given on the command line cannot be read."""
