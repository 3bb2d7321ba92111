#!/usr/bin/env python3
"""Which of a host's recent commits our patch series applies to.

    python scripts/patch_coverage.py verl=/path/to/verl skyrl=/path/to/SkyRL \
        slime=/path/to/slime nemo_rl=/path/to/NeMo-RL [--days 60] [--list]

For each host (``NAME=CLONE``: ``patches/NAME/*.patch`` against a clone with full history, its
``HEAD`` at the pinned commit), the window is the ``--days`` days up to the newest commit anywhere
in the clone's history (every ref), and the commits are those of the default branch
(``origin/HEAD``, else ``HEAD``; first parent: the states the branch really had) committed in it.
For each commit, the files the series touches are taken at that commit and the patches applied
in order, twice:

* ``exact``: ``git apply`` with no fuzz (what ``launch/apply_*_patches.sh`` accepts, with GNU
  ``patch -F0``, up to line offsets);
* ``3way``: ``git apply --3way``: a hunk whose context moved or changed is merged against the
  pinned file it was made from (the patches carry no blob ids, so the script first replays them on
  the pinned files and records each file's pre- and post-image), applying when the upstream change
  does not touch the patched lines.

It prints, per host, the window, the count of commits each way applies to, and the first patch
that fails at each commit that fails (``--list``: every commit). Nothing in the clones is changed:
the work is done in a scratch repository that borrows their objects.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

REPO = pathlib.Path(__file__).resolve().parents[1]


def git(repo: str, *args: str, input: Optional[bytes] = None, check: bool = True) -> str:
    out = subprocess.run(["git", "-C", repo, *args], input=input, capture_output=True, check=False)
    if check and out.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {out.stderr.decode(errors='replace')}")
    return out.stdout.decode(errors="replace")


def touched_files(patch: str) -> List[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch, flags=re.M)


def split_files(patch: str) -> List[Tuple[str, str]]:
    """``(path, text)`` of each file section of a unified diff (``--- a/`` .. next section)."""
    sections: List[Tuple[str, str]] = []
    lines = patch.splitlines(keepends=True)
    start = None
    for i, line in enumerate(lines):
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ b/"):
            if start is not None:
                sections.append(_section(lines[start:i]))
            start = i
    if start is not None:
        sections.append(_section(lines[start:]))
    return sections


def _section(lines: Sequence[str]) -> Tuple[str, str]:
    body = [line for line in lines if not line.startswith("diff --git")]
    path = body[1][len("+++ b/") :].split()[0]
    return path, "".join(body)


class Scratch:
    """A scratch repository borrowing the clone's objects; its work tree holds one state of the
    touched files at a time."""

    def __init__(self, clone: str, root: str):
        self.clone, self.root = clone, root
        git(root, "init", "-q")
        objects = git(clone, "rev-parse", "--git-path", "objects").strip()
        alternates = pathlib.Path(root, ".git", "objects", "info", "alternates")
        alternates.write_text(str(pathlib.Path(clone, objects).resolve()) + "\n")
        git(root, "config", "user.email", "coverage@example.invalid")
        git(root, "config", "user.name", "coverage")

    def load(self, commit: str, files: Sequence[str]) -> List[str]:
        """The touched files as at ``commit`` (staged); returns those missing there."""
        for path in files:
            target = pathlib.Path(self.root, path)
            if target.exists():
                target.unlink()
        missing = []
        for path in files:
            blob = subprocess.run(
                ["git", "-C", self.clone, "show", f"{commit}:{path}"], capture_output=True
            )
            if blob.returncode:
                missing.append(path)
                continue
            target = pathlib.Path(self.root, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(blob.stdout)
        git(self.root, "add", "-A")
        git(self.root, "reset", "-q", "--soft", "HEAD", check=False)
        return missing

    def blob(self, path: str) -> str:
        return git(self.root, "hash-object", "-w", path).strip()

    def apply(self, patch: str, *args: str) -> bool:
        out = subprocess.run(
            ["git", "-C", self.root, "apply", "--whitespace=nowarn", *args],
            input=patch.encode(),
            capture_output=True,
        )
        return out.returncode == 0


def with_blob_ids(scratch: Scratch, pin: str, patches: List[Tuple[str, str]], files) -> List[str]:
    """The patches with ``diff --git`` / ``index PRE..POST`` headers, replayed on the pinned files
    so that ``--3way`` finds each hunk's pre-image."""
    missing = scratch.load(pin, files)
    if missing:
        raise RuntimeError(f"the pinned commit {pin} lacks {missing}")
    out = []
    for name, text in patches:
        parts = []
        for path, section in split_files(text):
            pre = scratch.blob(path)
            if not scratch.apply(section, "--index"):
                raise RuntimeError(f"{name} does not apply to the pinned commit {pin} ({path})")
            post = scratch.blob(path)
            parts.append(f"diff --git a/{path} b/{path}\nindex {pre}..{post} 100644\n{section}")
        out.append("".join(parts))
    return out


def window(clone: str, days: int) -> Tuple[datetime.datetime, str, List[Tuple[str, str]]]:
    """The newest commit time in the whole history, the branch, and its first-parent commits
    of the last ``days`` days up to it (``(sha, date)``, newest first)."""
    newest = max(int(t) for t in git(clone, "log", "--all", "--format=%ct").split())
    end = datetime.datetime.fromtimestamp(newest, tz=datetime.timezone.utc)
    since = end - datetime.timedelta(days=days)
    branch = "origin/HEAD"
    if subprocess.run(
        ["git", "-C", clone, "rev-parse", "-q", "--verify", branch], capture_output=True
    ).returncode:
        branch = "HEAD"
    log = git(
        clone, "log", "--first-parent", f"--since={since.isoformat()}", "--format=%H %cs", branch
    )
    return end, branch, [tuple(line.split()) for line in log.splitlines() if line]


def host_coverage(name: str, clone: str, days: int, listing: bool) -> Dict[str, int]:
    patch_dir = REPO / "patches" / name
    patches = [(p.name, p.read_text()) for p in sorted(patch_dir.glob("*.patch"))]
    files = sorted({f for _, text in patches for f in touched_files(text)})
    pin = git(clone, "rev-parse", "HEAD").strip()
    end, branch, commits = window(clone, days)
    counts = {"commits": len(commits), "exact": 0, "3way": 0}
    failures: List[str] = []
    with tempfile.TemporaryDirectory() as root:
        scratch = Scratch(clone, root)
        indexed = with_blob_ids(scratch, pin, patches, files)
        for sha, date in commits:
            results = {}
            for mode, args in (("exact", ("--index",)), ("3way", ("--3way",))):
                missing = scratch.load(sha, files)
                failed = None
                if missing:
                    failed = f"missing {missing[0]}"
                else:
                    for (patch_name, _), text in zip(patches, indexed, strict=True):
                        if not scratch.apply(text, *args):
                            failed = patch_name
                            break
                        git(root, "add", "-A")
                results[mode] = failed
                counts[mode] += failed is None
            line = (
                f"  {sha[:9]} {date}  exact: {results['exact'] or 'applies'}; "
                f"3way: {results['3way'] or 'applies'}"
            )
            if listing or results["3way"]:
                failures.append(line)
    pin_date = git(clone, "log", "-1", "--format=%cs", pin).strip()
    print(
        f"{name}: {clone} (pin {pin[:9]} {pin_date}); {days} days up to the newest commit "
        f"({end:%Y-%m-%d}), {branch}, first parent: {counts['commits']} commits; the series "
        f"({len(patches)} patches) applies exactly to {counts['exact']}, with --3way to "
        f"{counts['3way']}."
    )
    for line in failures:
        print(line)
    return counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hosts", nargs="+", help="NAME=CLONE (NAME: a folder of patches/)")
    parser.add_argument("--days", type=int, default=60)
    parser.add_argument("--list", action="store_true", help="every commit, not only failures")
    args = parser.parse_args(argv)
    for spec in args.hosts:
        name, _, clone = spec.partition("=")
        if not clone or not (REPO / "patches" / name).is_dir():
            parser.error(f"{spec!r}: give NAME=CLONE with patches/NAME holding the series")
        host_coverage(name, os.path.abspath(clone), args.days, args.list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
