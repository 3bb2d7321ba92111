"""Megatron's ``data_iterator`` argument for a list of micro-batches: one iterator per model chunk.

The interleaved schedule calls ``forward_step_func`` once per (micro-batch, model chunk) and reads
each chunk's next micro-batch from that chunk's own iterator, so with ``vpp`` chunks it needs a list
of ``vpp`` iterators walking the same micro-batches in order; the other schedules take one iterator.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Sequence, Union

from megatron_dynbatch.errors import DynBatchValueError

__all__ = ["MicroBatchIterator", "chunk_data_iterators"]


class MicroBatchIterator:
    """An iterator over a step's micro-batches that also says where it stands: ``offset`` (the
    next micro-batch's index) and ``row_shape(k)`` (micro-batch ``k``'s ``(rows, length)``), the
    two things :mod:`megatron_dynbatch.mcore.contained` reads to stand in for a micro-batch."""

    def __init__(self, microbatches: Sequence[Any]) -> None:
        self.microbatches = microbatches
        self.offset = 0

    def __iter__(self) -> "MicroBatchIterator":
        return self

    def __next__(self) -> Any:
        if self.offset >= len(self.microbatches):
            raise StopIteration
        self.offset += 1
        return self.microbatches[self.offset - 1]

    def row_shape(self, index: int) -> tuple:
        return tuple(self.microbatches[index]["tokens"].shape[:2])


def chunk_data_iterators(
    microbatches: Sequence[Any],
    num_model_chunks: int,
    wrap: Callable[[Iterator[Any]], Any] = lambda iterator: iterator,
) -> Union[Any, List[Any]]:
    """One iterator over ``microbatches`` per model chunk (a bare iterator for a single chunk).

    Args:
        microbatches: This rank's micro-batches of the step, in schedule order.
        num_model_chunks: Model chunks on this rank (``vpp``, or 1 without interleaving).
        wrap: Applied to every iterator, e.g. Megatron's ``RerunDataIterator``.
    """
    if isinstance(num_model_chunks, bool) or not isinstance(num_model_chunks, int):
        raise DynBatchValueError(f"num_model_chunks={num_model_chunks!r} must be an integer >= 1.")
    if num_model_chunks < 1:
        raise DynBatchValueError(
            f"num_model_chunks={num_model_chunks} must be >= 1 (one per model chunk)."
        )
    if num_model_chunks == 1:
        return wrap(MicroBatchIterator(microbatches))
    return [wrap(MicroBatchIterator(microbatches)) for _ in range(num_model_chunks)]
