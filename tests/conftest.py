"""Shared fixtures and the rules every test module follows.

* Every test carries one kind marker (``unit``, ``gloo``, ``torchrun``, ``slime``, ``skyrl``,
  ``verl``, ``nemo_rl``; registered in pytest.ini), set explicitly by its module's ``pytestmark``
  or on the test. Collection fails on a test without one, so the fast default (``pytest``: ``-m
  "not torchrun and not slime and not skyrl and not verl and not nemo_rl"``) can never drop a new
  test silently. ``scripts/test.sh`` runs every kind (``-m ""``).
* ``slime`` / ``skyrl`` / ``verl`` / ``nemo_rl`` tests need a checkout of that trainer in
  ``SLIME_DIR`` / ``SKYRL_DIR`` / ``VERL_DIR`` / ``NEMO_RL_DIR``; without one they are skipped
  here, in one place, with the reason.
* No test writes into the repository: files go to pytest's ``tmp_path`` or to the temporary
  directories below (the README commands run in a scratch working directory).
* Under pytest-xdist (``scripts/test.sh``: ``-n 2 --dist loadfile``, a module to one worker) the
  modules that launch processes are handed out first and the unit modules last
  (:func:`_heaviest_first`): the many short unit modules fill the cores while launches start up,
  and the two workers finish together instead of one waiting on a launch it picked up last.
"""

import os
import shlex
import sys

import pytest

from tests._support import REPO, readme_block, run_shell

#: The markers that say what a test needs (see pytest.ini).
KINDS = ("unit", "gloo", "torchrun", "slime", "skyrl", "verl", "nemo_rl")

SLIME_DIR = os.environ.get("SLIME_DIR")

#: Kinds that need a trainer's checkout: the variable that names it, and where its commit is named.
CHECKOUTS = {
    "slime": ("SLIME_DIR", "patches/slime/README.md"),
    "skyrl": ("SKYRL_DIR", "patches/skyrl/README.md"),
    "verl": ("VERL_DIR", "patches/verl/README.md"),
    "nemo_rl": ("NEMO_RL_DIR", "patches/nemo_rl/README.md"),
}


def pytest_collection_modifyitems(config, items):
    """Refuse tests without a kind marker; skip a trainer's tests when its checkout is not set;
    under pytest-xdist, hand out the modules that launch processes first."""
    unmarked = sorted({item.nodeid.split("::")[0] for item in items if not _kinds(item)})
    if unmarked:
        raise pytest.UsageError(
            f"test module(s) without a kind marker: {', '.join(unmarked)}; add a module-level "
            f"`pytestmark = pytest.mark.<kind>` with one of {', '.join(KINDS)} (see tests/conftest.py)"
        )
    for kind, (variable, readme) in CHECKOUTS.items():
        if os.environ.get(variable):
            continue
        skip = pytest.mark.skip(
            reason=f"{variable} is not set: point it at a {kind} checkout (the commit is named in "
            f"{readme}) to run the tests against {kind}'s own code"
        )
        for item in items:
            if kind in _kinds(item):
                item.add_marker(skip)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = _heaviest_first(items)


#: The order modules are handed to xdist workers in: the slowest kinds first (a module goes by its
#: slowest test). Every worker sorts the same collection the same way, as xdist requires.
_HAND_OUT_ORDER = ("torchrun", "slime", "skyrl", "verl", "nemo_rl", "gloo", "unit")


def _heaviest_first(items):
    """``items`` with whole modules reordered by their slowest kind; the order within a module and
    between modules of one kind unchanged (a stable sort)."""
    rank = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        slowest = min(_HAND_OUT_ORDER.index(kind) for kind in _kinds(item))
        rank[module] = min(rank.get(module, slowest), slowest)
    return sorted(items, key=lambda item: rank[item.nodeid.split("::")[0]])


def _kinds(item) -> set:
    return {mark.name for mark in item.iter_markers() if mark.name in KINDS}


# -- scratch directories ------------------------------------------------------------------------


@pytest.fixture
def out_dir(tmp_path):
    """An empty ``out`` folder for logs and reports (instead of the repository's ``out/``)."""
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def readme_workdir(tmp_path_factory):
    """A scratch working directory for the README's commands, with the bundled corpus built in it.

    The README's commands use paths relative to the repository (``launch/...``, ``data/...``,
    ``out/...``). Here ``launch`` is a link to the repository's, so the scripts run from the
    repository while ``data/`` and ``out/`` land in this directory. The corpus is built once per
    session by the README's own ``data`` block (``launch/make_pydoc_corpus.py`` and the
    preprocessor), ``python`` being this interpreter.
    """
    workdir = tmp_path_factory.mktemp("readme")
    (workdir / "launch").symlink_to(REPO / "launch")
    (workdir / "out").mkdir()
    data = readme_block("data").replace("python ", f"{shlex.quote(sys.executable)} ")
    run_shell(data, workdir, workdir / "out" / "data.log")
    assert (workdir / "data" / "pydoc_text_document.idx").is_file()
    return workdir
