"""The slime and SkyRL patch files themselves (no checkout needed): small hunks with little context,
our code only behind the flag, a README line for each (issue 29: patches that broke on upstream's
next commits had three lines of context around lines that change)."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[2]
SERIES = {name: sorted((REPO / "patches" / name).glob("*.patch")) for name in ("slime", "skyrl")}
#: Context lines a hunk may keep on each side (0005 of slime: its neighbours are parentheses).
MAX_CONTEXT = {"0005-arguments-oversize-samples.patch": 2}
#: Added lines of one hunk, at most: the logic lives in megatron_dynbatch.
MAX_ADDED = 10


def _hunks(patch):
    return [h for h in re.split(r"^@@.*@@.*$", patch.read_text(), flags=re.M)[1:]]


@pytest.mark.parametrize("name", sorted(SERIES))
def test_hunks_are_small_and_anchored_on_few_lines(name):
    assert SERIES[name]
    for patch in SERIES[name]:
        allowed = MAX_CONTEXT.get(patch.name, 1)
        for hunk in _hunks(patch):
            lines = [x for x in hunk.splitlines() if x[:1] in (" ", "+", "-") and x[:3] != "+++"]
            leading = next(i for i, x in enumerate(lines) if x[0] != " ")
            trailing = next(i for i, x in enumerate(reversed(lines)) if x[0] != " ")
            where = f"{patch.name}: {hunk.splitlines()[1] if len(hunk.splitlines()) > 1 else ''}"
            assert leading <= allowed and trailing <= allowed, (where, leading, trailing)
            added = [x for x in lines if x[0] == "+"]
            assert len(added) <= MAX_ADDED, (where, len(added))


@pytest.mark.parametrize("name", sorted(SERIES))
def test_our_code_runs_only_behind_the_flag(name):
    """Every hunk that imports megatron_dynbatch reads the flag first: ``use_dynamic_batch_size``
    (SkyRL), or (slime's trainer side) the ``dynbatch_seq_lengths`` key the rollout side ships only
    then."""
    for patch in SERIES[name]:
        for hunk in _hunks(patch):
            added = [x[1:] for x in hunk.splitlines() if x.startswith("+") and x[:3] != "+++"]
            if any("megatron_dynbatch" in x and "import" in x for x in added):
                guards = ("use_dynamic_batch_size", '"dynbatch_seq_lengths" in rollout_data')
                assert any(g in x for g in guards for x in added), (patch.name, hunk)


def test_slime_reaches_us_through_one_generic_hook():
    """slime's patches hold the switch's condition nowhere (it is decided once, by the planner
    named by ``--micro-batch-planner-path``, in slime's argument validation); each call site reads
    the option, and only the data iterator (behind the key the planner ships) imports us."""
    text = "".join(p.read_text() for p in SERIES["slime"])
    added = [x[1:] for x in text.splitlines() if x.startswith("+") and x[:3] != "+++"]
    assert not any("use_slime_dynamic_batch_size" in x for x in added)
    assert not any("use_dynamic_batch_size" in x for x in added)
    imports = [x for x in added if "import" in x and "megatron_dynbatch" in x]
    assert imports == [
        "        from megatron_dynbatch.integrations.slime.backend import data_iterators"
    ], imports
    assert sum("micro_batch_planner_path" in x for x in added) >= 7


@pytest.mark.parametrize("name", sorted(SERIES))
def test_every_patch_has_a_readme_line_and_the_readme_says_how_to_regenerate(name):
    readme = (REPO / "patches" / name / "README.md").read_text()
    for patch in SERIES[name]:
        assert patch.name in readme, patch.name
    assert "Regenerating a patch" in readme and "diff -U1" in readme
