"""The error classes every layer shares: one base, and a ``ValueError`` branch for bad input.

Standard library only, so the pure planner can raise them. Catch :class:`DynBatchError` for
anything this package raised on purpose; :class:`DynBatchValueError` is bad input (a length, an id,
a flag) whose message names the values and the fix. Internal invariants stay ``AssertionError``
subclasses (``PlanInvariantError``): they mean a bug here, not in the caller's input.
"""

from __future__ import annotations

__all__ = ["DynBatchError", "DynBatchRuntimeError", "DynBatchTypeError", "DynBatchValueError"]


class DynBatchError(Exception):
    """Base of every error megatron_dynbatch raises on purpose."""


class DynBatchValueError(DynBatchError, ValueError):
    """Bad input: the message names the values and says how to fix them."""


class DynBatchRuntimeError(DynBatchError, RuntimeError):
    """A run-time condition this package detected and refuses (not bad input): the message says why."""


class DynBatchTypeError(DynBatchError, TypeError):
    """An argument of the wrong type: the message names it and the type expected."""
