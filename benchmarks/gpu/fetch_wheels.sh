#!/usr/bin/env bash
# Download, here, the Python 3.12 wheels the H200 machine lacks for benchmarks/laya_gpu.py, into
# .whl/ (ignored by git through .git/info/exclude), and build omnigraph's own wheel beside them.
#
# Run from the repository root:  bash benchmarks/gpu/fetch_wheels.sh
#
# What the GPU machine lacks (its package list is in the device notes, KINDS.md):
#   laya 0.4.15          the reference implementation (its own needs, torch, transformers,
#                        safetensors, huggingface_hub and numpy, are there)
#   laya-cuda 0.1.1.post1  the CuPy engine; it declares cupy-cuda12x and nvidia-*-cu12, but runs on the
#                        machine's cupy-cuda13x and CUDA 13 libraries, so it is installed with
#                        --no-deps and h200_run.sh checks that it imports and runs
#   pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions
#                        the deploy-YAML schema (omnigraph.pipelines.deploy) that AsyncOmni builds
#   fastapi, starlette, uvicorn, httptools, swagger-ui-bundle
#                        `omnigraph serve`, for laya_gpu.py's http path
#   posix_ipc            the worker mailbox's doorbells: without it workers serve through the socket
#   omnigraph (built from this tree)
#                        only for its entry point (`omnigraph.pipelines` -> laya): the code itself
#                        is imported from the working tree, which h200_run.sh puts first on PYTHONPATH
#
# Every wheel counts toward the 64 MiB a device run carries (4.5 MiB in all); the script
# prints the total. Keep one version of each package in .whl: two stop the whole install there.
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
PYTHON=${PYTHON:-.venv/bin/python}
DEST=.whl

grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
rm -rf "$DEST"
mkdir -p "$DEST"

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
PACKAGES=(
  laya==0.4.15
  laya-cuda==0.1.1.post1
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  fastapi==0.136.3
  starlette==1.10.0
  uvicorn==0.55.0
  httptools==0.9.0
  posix_ipc==1.3.2
  swagger-ui-bundle==1.1.0
)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${PACKAGES[@]}"
# From the committed tree, in a scratch folder: setuptools writes build/ and *.egg-info where it builds.
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
mkdir "$SCRATCH/src"
git archive HEAD | tar -x -C "$SCRATCH/src"
if ! "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$SCRATCH/src" > "$SCRATCH/log" 2>&1; then
  cat "$SCRATCH/log" >&2
  exit 1
fi

ls -la "$DEST"
du -cb "$DEST"/*.whl | tail -1 | awk '{printf "wheels: %.2f MiB\n", $1 / 1048576}'
