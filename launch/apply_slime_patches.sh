#!/usr/bin/env bash
# Apply megatron_dynbatch's slime patches (patches/slime/*.patch, in order) to a slime checkout.
#
#   launch/apply_slime_patches.sh SLIME_DIR
#
# SLIME_DIR is the directory holding slime/ (a checkout of github THUDM/slime at the commit named
# in patches/slime/README.md). All patches are first applied to a scratch copy of the files they
# touch; only if every one applies cleanly (no fuzz) is the real tree changed, so a failure leaves
# SLIME_DIR untouched. If every patch is already applied it says so and exits 0.
set -euo pipefail

usage() {
    echo "usage: $0 SLIME_DIR" >&2
    exit 2
}

[[ $# -eq 1 ]] || usage
target=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patch_dir=${MEGATRON_DYNBATCH_SLIME_PATCH_DIR:-$here/../patches/slime}

command -v patch >/dev/null || { echo "error: GNU patch is required (apt-get install patch)." >&2; exit 1; }
[[ -d $target/slime/backends/megatron_utils ]] || {
    echo "error: $target/slime/backends/megatron_utils does not exist; pass the slime checkout root." >&2
    exit 1
}
shopt -s nullglob
patches=("$patch_dir"/*.patch)
[[ ${#patches[@]} -gt 0 ]] || { echo "error: no patches found in $patch_dir." >&2; exit 1; }

# Files the patches touch, from their '+++ b/<path>' headers.
mapfile -t files < <(sed -n 's#^+++ b/\([^[:space:]]*\).*#\1#p' "${patches[@]}" | sort -u)

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
copy_tree() {  # copy the touched files of $1 into $2
    for f in "${files[@]}"; do
        [[ -f $1/$f ]] || {
            echo "error: $1/$f is missing; is this the slime commit named in patches/slime/README.md?" >&2
            exit 1
        }
        mkdir -p "$2/$(dirname "$f")"
        cp "$1/$f" "$2/$f"
    done
}

# Already applied? Reverse-apply the series, last patch first, on a scratch copy.
copy_tree "$target" "$scratch/reverse"
already=1
for ((i = ${#patches[@]} - 1; i >= 0; i--)); do
    if ! patch -d "$scratch/reverse" -p1 -R -F0 --force --silent <"${patches[i]}" >/dev/null 2>&1; then
        already=0
        break
    fi
done
if [[ $already -eq 1 ]]; then
    echo "megatron_dynbatch slime patches are already applied to $target; nothing to do."
    exit 0
fi

# Forward on a scratch copy: every patch must apply exactly (fuzz 0), in order.
copy_tree "$target" "$scratch/forward"
for p in "${patches[@]}"; do
    if ! out=$(patch -d "$scratch/forward" -p1 -F0 --force <"$p" 2>&1); then
        echo "error: $(basename "$p") does not apply to $target; nothing was changed." >&2
        echo "$out" >&2
        echo "These patches are made for the slime commit named in patches/slime/README.md." >&2
        exit 1
    fi
done

# Everything applied cleanly: install the patched files.
for f in "${files[@]}"; do
    cp "$scratch/forward/$f" "$target/$f"
done
for p in "${patches[@]}"; do
    echo "applied $(basename "$p")"
done
