#!/usr/bin/env bash
# Create (or reuse) .venv with everything the project needs on a CPU machine. Idempotent: a stamp
# keyed on requirements.txt and setup.py skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.installed-$(cat requirements.txt setup.py | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[bootstrap] installing into .venv (about a minute on a fresh machine)" >&2
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
  # megatron-core 0.19.2 declares Requires-Python >=3.12 but its cp311 wheel works on 3.11;
  # --no-deps stops pip from trying to build numpy from source (see docs/cpu.md).
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --ignore-requires-python \
    megatron-core==0.19.2
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
  rm -f .venv/.installed-*
  touch "$stamp"
fi
# The editable package's bytecode, as pip writes it for installed packages. Where Python may not
# write bytecode itself (PYTHONDONTWRITEBYTECODE), every rank process of every launch compiled the
# modules it imports again (about 0.2-0.5 s of CPU each on 2 cores). Up-to-date files are skipped.
.venv/bin/python -m compileall -q megatron_dynbatch >/dev/null || true
