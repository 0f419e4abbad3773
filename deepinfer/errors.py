"""Typed errors for bad user input (checkpoints, configs).

Each message names the file and key it came from, what was expected, and how
to fix it; the CLI prints them on one line and exits non-zero.
"""


class DeepinferError(Exception):
    """Base class for errors caused by user input."""


def one_line(e: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class ConfigError(DeepinferError):
    """A config.json or model.toml value is missing, mistyped or impossible."""


class CheckpointError(DeepinferError):
    """A checkpoint tensor is missing, corrupt, or has the wrong dtype or shape."""


class TensorFileError(CheckpointError, ValueError):
    """A safetensors file (a checkpoint's or a bundle's) or one of its tensors is corrupt, truncated
    or of an unexpected dtype/shape. The message names the file and the tensor."""

    def __init__(self, path: str, tensor: str | None, problem: str, fix: str = ""):
        where = f"{path}" + (f", tensor {tensor!r}" if tensor else "")
        super().__init__(f"{where}: {problem}" + (f" ({fix})" if fix else ""))
        self.path, self.tensor, self.problem, self.fix = path, tensor, problem, fix

    def __reduce__(self):  # raised in worker processes, re-raised in the parent
        return (type(self), (self.path, self.tensor, self.problem, self.fix))


class CompareError(DeepinferError):
    """A logit dump or noise-floor file is missing, malformed, or does not match the other."""


class ImageError(DeepinferError):
    """An image file is unreadable, of an unsupported format, or does not fit the vision config."""
