"""Shared fixtures and the rules every test module follows.

* Every test carries one kind marker (``unit``, ``gloo``, ``torchrun``, ``slime``; registered in
  pytest.ini), set explicitly by its module's ``pytestmark`` or on the test. Collection fails on a
  test without one, so the fast default (``pytest``: ``-m "not torchrun and not slime"``) can never
  drop a new test silently. ``scripts/test.sh`` runs every kind (``-m ""``).
* ``slime`` tests need a slime checkout in ``SLIME_DIR``; without one they are skipped here, in one
  place, with the reason.
* No test writes into the repository: files go to pytest's ``tmp_path`` or to the temporary
  directories below (the README commands run in a scratch working directory).
"""

import os
import shlex
import sys

import pytest

from tests._support import REPO, readme_block, run_shell

#: The markers that say what a test needs (see pytest.ini).
KINDS = ("unit", "gloo", "torchrun", "slime")

SLIME_DIR = os.environ.get("SLIME_DIR")


def pytest_collection_modifyitems(config, items):
    """Refuse tests without a kind marker; skip ``slime`` tests when SLIME_DIR is unset."""
    unmarked = sorted({item.nodeid.split("::")[0] for item in items if not _kinds(item)})
    if unmarked:
        raise pytest.UsageError(
            f"test module(s) without a kind marker: {', '.join(unmarked)}; add a module-level "
            f"`pytestmark = pytest.mark.<kind>` with one of {', '.join(KINDS)} (see tests/conftest.py)"
        )
    if SLIME_DIR:
        return
    skip = pytest.mark.skip(
        reason="SLIME_DIR is not set: point it at a slime checkout (the commit is named in "
        "patches/slime/README.md) to run the tests against slime's own code"
    )
    for item in items:
        if "slime" in _kinds(item):
            item.add_marker(skip)


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
