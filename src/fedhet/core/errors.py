"""Exceptions with messages meant for the person running fedhet.

Every error a user can cause (bad config, missing data, impossible partition, corrupt
checkpoint) is a FedhetError whose message says what is wrong and how to fix it; the CLI
prints it without a traceback.
"""


class FedhetError(Exception):
    """Base class for errors caused by input the user can fix."""


class ConfigError(FedhetError):
    """A config key is unknown, missing or has a bad value."""


class DataError(FedhetError):
    """A dataset file is missing, corrupt or malformed."""


class PartitionError(FedhetError):
    """A partition cannot be satisfied with the given data and parameters."""


class CheckpointError(FedhetError):
    """A checkpoint or run directory cannot be used to resume."""


class NumericalError(FedhetError):
    """A loss or parameter became non-finite during training."""


class OutputError(FedhetError):
    """A run directory or output file cannot be created or written (full disk, permissions)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned by the command line into what Ctrl-C raises: a sweep tells it apart, since
    a Ctrl-C in a terminal reaches its runs too and SIGTERM does not."""
