"""The command line's wording of planner messages: settings named by its own flags.

The planner names a setting by its config field (``vpp_size=2 needs pp_size >= 2``); ``plan``
and ``verify`` print its refusals and warnings with their own flags in place
(:func:`flags_in_place`), so a message reads as the command was typed.
"""

from __future__ import annotations

import re
from typing import List

__all__ = ["flags_in_place"]

#: The tail a planner message ends with, naming where each setting it names is set (the form
#: every host shares, ``planning.spec.setting_flags``): ``(flags: [tool: ]key is flag; ...)``.
_GLOSSARY = re.compile(r" \(flags: (?:[\w-]+: )?(?P<entries>.*)\.\)$")


def flags_in_place(message: str) -> str:
    """``message`` with each setting it names by its field (``vpp_size=2 needs pp_size >= 2``)
    named by this command's flag in place (``--vpp-size=2 needs --pp-size >= 2``), where that flag
    is one word; the ``(flags: ...)`` tail keeps only what was not named in place. Fields are
    replaced only as whole identifiers (not after a dot: ``PlannerConfig.cap`` stays)."""
    from megatron_dynbatch.config import FLAGS
    from megatron_dynbatch.planning.spec import LAYOUT_FLAGS, without_field_hints

    names = {**FLAGS, **LAYOUT_FLAGS["megatron-dynbatch"]}
    kept: List[str] = []
    message = without_field_hints(message)  # the flags name them here
    match = _GLOSSARY.search(message)
    body = message[: match.start()] if match else message
    for entry in match.group("entries").split("; ") if match else ():
        key, _, flag = entry.partition(" is ")
        if "_" in key and re.fullmatch(r"--[\w-]+", flag):
            names[key] = flag
        else:
            kept.append(entry)
    for key, flag in names.items():
        if "_" in key:  # identifiers only: a plain word (layout) may be prose
            body = re.sub(rf"(?<![.\w-]){re.escape(key)}\b", flag, body)
    return body + (f" (flags: {'; '.join(kept)}.)" if kept else "")
