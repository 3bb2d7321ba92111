#!/usr/bin/env bash
# Apply megatron_dynbatch's NeMo-RL patches (patches/nemo_rl/*.patch, in order) to a NeMo-RL checkout.
#
#   launch/apply_nemo_rl_patches.sh NEMO_RL_DIR
#
# NEMO_RL_DIR is the directory holding nemo_rl/ (a checkout of github NVIDIA-NeMo/RL at the commit
# named in patches/nemo_rl/README.md). All or nothing, idempotent: see launch/patch_series.sh.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 NEMO_RL_DIR" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/patch_series.sh" "$1" "${MEGATRON_DYNBATCH_NEMO_RL_PATCH_DIR:-$here/../patches/nemo_rl}" \
    nemo_rl/models/megatron "NeMo-RL patches" \
    "These patches are made for the NeMo-RL commit named in patches/nemo_rl/README.md."
