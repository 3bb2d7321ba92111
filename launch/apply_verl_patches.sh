#!/usr/bin/env bash
# Apply megatron_dynbatch's verl patches (patches/verl/*.patch, in order) to a verl checkout.
#
#   launch/apply_verl_patches.sh VERL_DIR
#
# VERL_DIR is the directory holding verl/ (a checkout of github verl-project/verl at the commit
# named in patches/verl/README.md). All or nothing, idempotent: see launch/patch_series.sh.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 VERL_DIR" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/patch_series.sh" "$1" "${MEGATRON_DYNBATCH_VERL_PATCH_DIR:-$here/../patches/verl}" \
    verl/workers/engine/megatron "verl patches" \
    "These patches are made for the verl commit named in patches/verl/README.md."
