"""``--log-progress``'s token count for document samples.

Megatron's ``compute_throughputs_and_append_to_progress_log`` writes ``Tokens (in billions)`` as
``consumed_train_samples x --seq-length`` into ``progress.txt`` at every checkpoint: right for its
GPTDataset, whose samples are all ``--seq-length`` long, but an overstatement for document samples
(``--use-dynamic-batch-size``, ``--document-samples``), which are documents cut at
``--seq-length``, most of them shorter. The split knows its samples' lengths in order
(``tokens_in_first``), so the figure is recounted from them, across resumes alike.

Wrapped, not copied: Megatron's function runs as it is and writes its own line; only the tokens
field of that line is replaced, through the ``append_to_progress_log`` name it calls. Where the
line does not have the field (another Megatron), it is written unchanged.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable

__all__ = ["count_progress_tokens"]

_TOKENS = re.compile(r"Tokens \(in billions\): [0-9.eE+-]+")


def count_progress_tokens(train: Any, get_args: Callable[[], Any]) -> bool:
    """Make ``--log-progress`` count the tokens of ``train``'s consumed samples.

    Args:
        train: The training split (``SplitSamples`` or ``BlendedSamples``: ``tokens_in_first``).
        get_args: Megatron's ``get_args`` (the consumed-sample counter at the time of the line).

    Returns:
        Whether Megatron's train loop was found and wrapped.
    """
    training = sys.modules.get("megatron.training.training")
    append = getattr(training, "append_to_progress_log", None)
    if append is None or getattr(append, "_dynbatch_counted", False):
        return False

    def counted(save_dir: str, string: str, *args: Any, **kwargs: Any) -> Any:
        consumed = int(getattr(get_args(), "consumed_train_samples", 0) or 0)
        if _TOKENS.search(string):
            tokens = train.tokens_in_first(consumed) if consumed else 0
            string = _TOKENS.sub(f"Tokens (in billions): {tokens / 10**9:.2f}", string)
        return append(save_dir, string, *args, **kwargs)

    counted._dynbatch_counted = True  # type: ignore[attr-defined]
    training.append_to_progress_log = counted
    return True
