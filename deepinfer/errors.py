"""Typed errors for bad user input (checkpoints, configs).

Each message names the file and key it came from, what was expected, and how
to fix it; the CLI prints them on one line and exits non-zero.
"""


class DeepinferError(Exception):
    """Base class for errors caused by user input."""


class ConfigError(DeepinferError):
    """A config.json or model.toml value is missing, mistyped or impossible."""


class CheckpointError(DeepinferError):
    """A checkpoint tensor is missing, corrupt, or has the wrong dtype or shape."""


class CompareError(DeepinferError):
    """A logit dump or noise-floor file is missing, malformed, or does not match the other."""


class ImageError(DeepinferError):
    """An image file is unreadable, of an unsupported format, or does not fit the vision config."""
