"""The error classes every layer shares: one base, and a ``ValueError`` branch for bad input.

Standard library only, so the pure planner can raise them. Catch :class:`DynBatchError` for
anything this package raised on purpose; :class:`DynBatchValueError` is bad input (a length, an id,
a flag) whose message names the values and the fix. Internal invariants stay ``AssertionError``
subclasses (``PlanInvariantError``): they mean a bug here, not in the caller's input.
"""

from __future__ import annotations

__all__ = ["DynBatchError", "DynBatchValueError"]


class DynBatchError(Exception):
    """Base of every error megatron_dynbatch raises on purpose."""


class DynBatchValueError(DynBatchError, ValueError):
    """Bad input: the message names the values and says how to fix them."""
