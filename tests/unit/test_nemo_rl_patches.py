"""patches/nemo_rl: every line that reaches megatron_dynbatch runs only behind the switch."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.unit

PATCHES = pathlib.Path(__file__).resolve().parents[2] / "patches" / "nemo_rl"
#: The guards an import of ours may sit under: the switch, (patch 0004) a list of model chunks,
#: which stock NeMo-RL never passes to ``megatron_forward_backward``, or (patch 0005) a
#: micro-batch carrying our marker key, which only our shards have.
GUARDS = (
    re.compile(r'^\+\s+if \(config\.get\("megatron_cfg"\) or \{\}\)\.get\("dynbatch"\):'),
    re.compile(r'^\+\s+if getattr\(data, "dynbatch_placeholder_rows", None\):'),
    re.compile(r"^\+\s+if isinstance\(model, list\) and len\(model\) > 1"),
    re.compile(r'^\+\s+if "dynbatch_sample_index" in data_dict:'),
)
#: The only reads of NeMo-RL's config in the patches: ``Policy.__init__`` reads the section once
#: (``None`` as absent) and holds the planner; every other line reads ``self.dynbatch`` or the
#: shard (``get("dynbatch", {})`` once crashed on an empty section).
CONFIG_READS = re.compile(r'get\("dynbatch"')


def _hunks(text):
    hunk = []
    for line in text.splitlines():
        if line.startswith("@@"):
            if hunk:
                yield hunk
            hunk = []
        elif hunk is not None:
            hunk.append(line)
    if hunk:
        yield hunk


def test_every_import_of_ours_is_behind_a_guard():
    patches = sorted(PATCHES.glob("*.patch"))
    assert len(patches) == 5
    imports = 0
    for patch in patches:
        for hunk in _hunks(patch.read_text()):
            guarded_at = None
            for i, line in enumerate(hunk):
                if any(g.match(line) for g in GUARDS):
                    guarded_at = (i, len(line) - len(line.lstrip("+ ")))
                if "megatron_dynbatch" in line and line.startswith("+") and "import" in line:
                    imports += 1
                    assert guarded_at is not None, f"{patch.name}: unguarded {line.strip()}"
                    indent = len(line) - len(line.lstrip("+ "))
                    assert indent > guarded_at[1], f"{patch.name}: {line.strip()} not in the if"
    assert imports == 5


def test_the_section_is_read_once_and_none_reads_as_absent():
    reads = [
        line
        for patch in sorted(PATCHES.glob("*.patch"))
        for line in patch.read_text().splitlines()
        if line.startswith("+") and CONFIG_READS.search(line)
    ]
    assert reads == ['+        if (config.get("megatron_cfg") or {}).get("dynbatch"):'], reads


def test_the_readme_names_the_commit_and_every_patch():
    readme = (PATCHES / "README.md").read_text()
    assert "`7ea279a`" in readme
    for patch in PATCHES.glob("*.patch"):
        assert f"`{patch.name}`" in readme, patch.name
