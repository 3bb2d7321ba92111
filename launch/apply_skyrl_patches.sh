#!/usr/bin/env bash
# Apply megatron_dynbatch's SkyRL patches (patches/skyrl/*.patch, in order) to a SkyRL checkout.
#
#   launch/apply_skyrl_patches.sh SKYRL_DIR
#
# SKYRL_DIR is the directory holding skyrl/ (a checkout of github NovaSky-AI/SkyRL at the commit
# named in patches/skyrl/README.md). All or nothing, idempotent: see launch/patch_series.sh.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 SKYRL_DIR" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/patch_series.sh" "$1" "${MEGATRON_DYNBATCH_SKYRL_PATCH_DIR:-$here/../patches/skyrl}" \
    skyrl/backends/skyrl_train/workers/megatron "SkyRL patches" \
    "These patches are made for the SkyRL commit named in patches/skyrl/README.md."
