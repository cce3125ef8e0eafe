#!/usr/bin/env bash
# Run on the GPU machine from the repository root, once per part, in order (issue 23):
#
#   bash .gpu/vllm_join.sh K      # K = 0 .. N-1, each call carrying .gpu/vllm/pK and this script
#
# (benchmarks/gpu/fetch_vllm.sh made the parts and copied this script to .gpu/vllm_join.sh.) Each
# call checks part K's piece against its sha256 and keeps it under $HOME/.vllmgpu/parts. The call of
# the last part joins the pieces, checks every wheel's sha256 against the manifest, installs them
# all with `pip install --no-index --no-deps --target $HOME/.vllmgpu/site`, imports vllm and
# flashinfer from there, and checks each image package the wheels rely on (image.tsv). It writes
# the folders to put on PYTHONPATH into $HOME/.vllmgpu/pythonpath; afterwards, in every command that
# uses vLLM:
#
#   export PYTHONPATH=$(cat $HOME/.vllmgpu/pythonpath)${PYTHONPATH:+:$PYTHONPATH}
#
# Running a part again is harmless; so is running the last one again (it joins and installs again).
# A missing, corrupt or foreign part ends the call with a non-zero status and one line saying which.
set -euo pipefail

STATE=$HOME/.vllmgpu
fail() { echo "vllm_join.sh: $*" >&2; exit 1; }

[[ $# == 1 && $1 =~ ^[0-9]+$ ]] || fail "usage: bash .gpu/vllm_join.sh K (the part's index)"
index=$1
part=.gpu/vllm/p$index
[[ -f $part/part.info && -f $part/piece ]] || fail "part $index was not carried: $PWD/$part has no part.info and piece"
read -r info_index total piece_sha set_id < "$part/part.info"
[[ $info_index == "$index" ]] || fail "$part/part.info says it is part $info_index, not $index"
echo "$piece_sha  $part/piece" | sha256sum -c --quiet - >/dev/null 2>&1 \
  || fail "part $index is corrupt: its piece does not match the sha256 in $part/part.info"

mkdir -p "$STATE/parts"
if [[ -f $STATE/set_id && $(cat "$STATE/set_id") != "$set_id" ]]; then
  fail "part $index is of wheel set $set_id, the parts here are of $(cat "$STATE/set_id"): rm -rf $STATE, then join from part 0"
fi
echo "$set_id" > "$STATE/set_id"
cp "$part/piece" "$STATE/parts/piece-$index.tmp"
mv "$STATE/parts/piece-$index.tmp" "$STATE/parts/piece-$index"
cp "$part/manifest.tsv" "$part/image.tsv" "$STATE/"
if (( index + 1 < total )); then
  echo "part $index of $total kept (set $set_id); next: bash .gpu/vllm_join.sh $((index + 1))"
  exit 0
fi

# The last part: every piece must be here (a machine given back between calls keeps none of them).
pieces=()
for (( i = 0; i < total; i++ )); do
  [[ -f $STATE/parts/piece-$i ]] || fail "part $i of $total is missing here (was the machine given back since it was joined?): join from part 0 again"
  pieces+=("$STATE/parts/piece-$i")
done
rm -rf "$STATE/wheels"
mkdir -p "$STATE/wheels"
cat "${pieces[@]}" | tar -xf - -C "$STATE/wheels" || fail "the $total pieces do not make a whole tar stream"
while IFS=$'\t' read -r name version sha bytes file; do
  [[ -f $STATE/wheels/$file ]] || fail "wheel $file ($name $version) is not in the joined parts"
  echo "$sha  $STATE/wheels/$file" | sha256sum -c --quiet - >/dev/null 2>&1 \
    || fail "wheel $file ($name $version, $bytes bytes) does not match its sha256 in manifest.tsv"
done < "$STATE/manifest.tsv"
echo "$(wc -l < "$STATE/manifest.tsv") wheels joined and checked; installing into $STATE/site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STATE/site" \
  "$STATE"/wheels/*.whl || fail "pip install --target $STATE/site failed (its output is above)"

# `pip install --target` leaves the wheels' .pth files unread: nvidia_cutlass_dsl_packages.pth would put
# nvidia_cutlass_dsl/dsl_packages (the `cutlass` package of the CuTe DSL) on sys.path, so it is named here.
site_path=$STATE/site:$STATE/site/nvidia_cutlass_dsl/dsl_packages
echo "$site_path" > "$STATE/pythonpath"

# What the wheels rely on from the image: importlib.metadata reads what `pip show` reads, for all
# of them in one process.
PYTHONPATH=$site_path python3 - "$STATE/image.tsv" <<'EOF'
import importlib.metadata as metadata
import sys

from packaging.specifiers import SpecifierSet

missing, differing = [], []
for line in open(sys.argv[1]):
    name, requirement = line.split()
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        missing.append(name)
        continue
    if requirement != "any" and not SpecifierSet(requirement).contains(version, prereleases=True):
        differing.append(f"{name} {version} (vllm's closure asks {requirement})")
print(f"image packages: {len(missing)} missing: {' '.join(missing) or '-'}")
print(f"image packages: {len(differing)} outside the closure's requirement (used as they are):")
for entry in differing:
    print(f"  {entry}")
EOF
PYTHONPATH=$site_path python3 -c '
import torch, vllm, flashinfer
print("vllm", vllm.__version__, vllm.__file__)
print("flashinfer", flashinfer.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))
' || fail "vllm or flashinfer does not import from $site_path (the traceback above names what is missing)"
# Optional: vLLM and flashinfer import it behind ImportError guards and run without their CuTe-DSL kernels.
PYTHONPATH=$site_path python3 -c 'import cutlass; print("cutlass (CuTe DSL)", cutlass.__file__)' \
  || echo "cutlass (CuTe DSL) does not import (above): vLLM and flashinfer run without their CuTe-DSL kernels"
echo "vLLM installed: export PYTHONPATH=\$(cat $STATE/pythonpath)\${PYTHONPATH:+:\$PYTHONPATH}"
