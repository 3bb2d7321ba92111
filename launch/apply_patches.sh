#!/usr/bin/env bash
# Apply megatron_dynbatch's patches (patches/*.patch, in order) to a Megatron-LM checkout.
#
#   launch/apply_patches.sh MEGATRON_LM_DIR
#
# MEGATRON_LM_DIR is the directory holding megatron/training/ (a Megatron-LM checkout, or the
# site-packages directory of an installed megatron-core that ships megatron/training). All or
# nothing, idempotent: see launch/patch_series.sh.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 MEGATRON_LM_DIR" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/patch_series.sh" "$1" "${MEGATRON_DYNBATCH_PATCH_DIR:-$here/../patches}" \
    megatron/training "patches" \
    "These patches are made for megatron-core / Megatron-LM 0.19.2 (see patches/README.md)."
