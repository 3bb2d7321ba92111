#!/usr/bin/env bash
# Apply megatron_dynbatch's slime patches (patches/slime/*.patch, in order) to a slime checkout.
#
#   launch/apply_slime_patches.sh SLIME_DIR
#
# SLIME_DIR is the directory holding slime/ (a checkout of github THUDM/slime at the commit named
# in patches/slime/README.md). All or nothing, idempotent: see launch/patch_series.sh.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 SLIME_DIR" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/patch_series.sh" "$1" "${MEGATRON_DYNBATCH_SLIME_PATCH_DIR:-$here/../patches/slime}" \
    slime/backends/megatron_utils "slime patches" \
    "These patches are made for the slime commit named in patches/slime/README.md."
