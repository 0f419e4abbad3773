"""Typed errors raised by deepinfer.quant for bad user input.

`QuantInputError` covers arguments that cannot be processed (wrong dtype or
shape, non-finite values where a format has no room for them). Errors about a
checkpoint file carry the file and tensor name in `deepinfer.errors.TensorFileError`.
Both derive from ValueError so generic callers can catch them as such.
"""

from __future__ import annotations

from deepinfer import errors


class QuantInputError(errors.DeepinferError, ValueError):
    """An array handed to a quant function is not what the format expects."""


def expect_dtype(arr, dtype, what: str):
    """Return `arr` as an ndarray, raising QuantInputError if its dtype is not
    `dtype` (no silent casts: a float64 weight or int8 code array is a caller
    bug that would otherwise be rounded or reinterpreted quietly)."""
    import numpy as np

    a = np.asarray(arr)
    if a.dtype != np.dtype(dtype):
        raise QuantInputError(
            f"{what}: expected dtype {np.dtype(dtype).name}, got {a.dtype.name} "
            f"(convert explicitly, e.g. .view(np.uint8) for raw fp8 codes)"
        )
    return a
