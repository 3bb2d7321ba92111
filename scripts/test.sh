#!/usr/bin/env bash
# The test command: sets up .venv on a fresh machine (scripts/bootstrap.sh), checks lint and format
# (ruff, black; settings in pyproject.toml), then runs the whole suite (unit, distributed gloo, real
# Megatron-Core schedules, torchrun launches of pretrain() and the CLI; slime's with SLIME_DIR).
# Plain `pytest` is the faster inner loop (unit and gloo only: addopts in pytest.ini); -m "" here
# selects every marker. Two pytest-xdist workers, a test module to each at a time (its fixtures stay
# in one worker; tests/conftest.py hands out the launching modules first): alone, a torchrun launch
# keeps the two cores busy about half its time. DYNBATCH_TEST_WORKERS sets another count (0: one
# process, no xdist). Extra arguments go to pytest (a later -m wins).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check --quiet . || { echo "lint failed: run .venv/bin/ruff check --fix ." >&2; exit 1; }
.venv/bin/black --check --quiet . || { echo "format drift: run .venv/bin/black ." >&2; exit 1; }
workers=${DYNBATCH_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -q -m "" "${parallel[@]}" "$@"
