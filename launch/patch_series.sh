#!/usr/bin/env bash
# The one implementation behind launch/apply_patches.sh (Megatron-LM) and apply_slime_patches.sh:
# apply a series of unified diffs (PATCH_DIR/*.patch, in order) to a source tree, all or nothing.
#
#   launch/patch_series.sh TARGET PATCH_DIR MARKER WHAT VERSION_HINT
#
# MARKER: a directory that must exist under TARGET (refuses a wrong root); WHAT: how messages name
# the series; VERSION_HINT: the sentence printed when a patch does not apply. Every patch is first
# applied to a scratch copy of the files the series touches; only if all apply exactly (fuzz 0) is
# TARGET changed, so a failure leaves it untouched. If the whole series is already applied it says
# so and exits 0.
set -euo pipefail

[[ $# -eq 5 ]] || { echo "usage: $0 TARGET PATCH_DIR MARKER WHAT VERSION_HINT" >&2; exit 2; }
target=$1 patch_dir=$2 marker=$3 what=$4 version_hint=$5

command -v patch >/dev/null || { echo "error: GNU patch is required (apt-get install patch)." >&2; exit 1; }
[[ -d $target/$marker ]] || {
    echo "error: $target/$marker does not exist; pass the root of the tree ($what)." >&2
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
        [[ -f $1/$f ]] || { echo "error: $1/$f is missing; $version_hint" >&2; exit 1; }
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
    echo "megatron_dynbatch $what are already applied to $target; nothing to do."
    exit 0
fi

# Forward on a scratch copy: every patch must apply exactly (fuzz 0), in order.
copy_tree "$target" "$scratch/forward"
for p in "${patches[@]}"; do
    if ! out=$(patch -d "$scratch/forward" -p1 -F0 --force <"$p" 2>&1); then
        echo "error: $(basename "$p") does not apply to $target; nothing was changed." >&2
        echo "$out" >&2
        echo "$version_hint" >&2
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
