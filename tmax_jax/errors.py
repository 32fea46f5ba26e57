"""Exception types shared across the package, so callers can catch by kind."""


class TmaxError(Exception):
    """Base class for every error tmax-jax raises on purpose."""


class ConfigError(TmaxError, ValueError):
    """A config file or override is malformed (unknown key, wrong type, bad value)."""


class CheckpointError(TmaxError):
    """A checkpoint directory is missing files, tensors, or has mismatched shapes."""


class TaskFormatError(TmaxError, ValueError):
    """A task directory does not follow the Harbor or TMAX layout."""


class SandboxError(TmaxError, RuntimeError):
    """A sandbox failed to start, died, or a backend is unavailable."""
