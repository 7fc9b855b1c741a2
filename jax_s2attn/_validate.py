"""Checks of user-supplied scalars, shared by every public entry point (host only, no jax arrays).

Each check raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for a value out
of range, naming the argument, what was given and what to pass instead.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["boolean", "integer", "positive_finite"]


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"a {type(value).__name__}"


def _is_real(value) -> bool:
    """A real number: Python or numpy, or a 0-d array of a real dtype (bfloat16 included)."""
    if isinstance(value, numbers.Real):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and np.ndim(value) == 0 and np.dtype(dtype).kind not in "bcOSUM"


def integer(value, name: str, minimum: int, hint: str = "") -> int:
    """``value`` as an ``int`` if it is an integer (``numbers.Integral``: Python or numpy ints, not bools)
    of at least ``minimum``; ``hint`` ends every message (e.g. "; pass ...")."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {_describe(value)} ({type(value).__name__}){hint}.")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {int(value)}{hint}.")
    return int(value)


def positive_finite(value, name: str, unit: str = "", hint: str = "") -> float:
    """``value`` as a ``float`` if it is a real number (Python or numpy, or a 0-d array of one) that is
    finite and greater than 0; ``unit`` completes the message (e.g. " in radians"), ``hint`` ends it."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise TypeError(f"{name} must be a number{unit}, got {_describe(value)} ({type(value).__name__}){hint}.")
    if not _is_real(value):
        raise TypeError(f"{name} must be a real number{unit}, got {_describe(value)} ({type(value).__name__}){hint}.")
    try:
        number = float(value)
    except Exception:  # a traced 0-d value (jax.errors.ConcretizationTypeError) has no float yet
        raise TypeError(
            f"{name} must be a concrete number{unit} (it fixes the computation), got a traced value; "
            "pass a Python float, or mark the argument static under jit."
        ) from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a finite number greater than 0{unit}, got {number!r}{hint}.")
    return number


def boolean(value, name: str) -> bool:
    """``value`` as a ``bool`` if it is one (Python or numpy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {_describe(value)} ({type(value).__name__}).")
    return bool(value)
