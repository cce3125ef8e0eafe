#!/usr/bin/env bash
# Download, here, the wheels vLLM 0.26.0 needs on the GPU machine that its image lacks, and cut them
# into part folders that each fit one device call (issue 23). Run from anywhere in the repository:
#
#   bash benchmarks/gpu/fetch_vllm.sh            # the core set (see OPTIONAL below)
#   FULL=1 bash benchmarks/gpu/fetch_vllm.sh     # the core set plus OPTIONAL
#
# Why vLLM 0.26.0: it pins torch==2.11.0, torchaudio==2.11.0, torchvision==0.26.0 and triton==3.6.0,
# exactly the image's (KINDS.md), so no torch travels; vllm 0.33 would need torch 2.14 (555 MB).
#
# How PACKAGES was found (2026-12-05): `pip install --dry-run --ignore-installed --report` of
# vllm==0.26.0 for CPython 3.12 on manylinux_2_17..2_39 x86_64, constrained to the image's known
# versions (torch 2.11.0, transformers 5.17.0, huggingface-hub 1.33.0, tokenizers 0.23.2, ...):
# 198 distributions. The 85 the image holds are not carried; they are listed in IMAGE with the
# requirement the closure puts on them, and the join checks each one there. The other 113 are
# PACKAGES (carried) and OPTIONAL (not carried by default).
#
# OPTIONAL: required by vllm's metadata but imported only inside the features that use them
# (checked in vllm 0.26.0's source: every import is in a function or behind an ImportError guard),
# none of which a Qwen3 pooling engine in bfloat16 on Hopper reaches. 418 MiB, 7 more parts:
#   tokenspeed-mla, tokenspeed-triton   MLA attention kernels (DeepSeek-style models)
#   humming-kernels, nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt, nvidia-cuda-cccl, pyelftools
#                                       the "humming" quantization kernels (--quantization humming)
#   tilelang, z3-solver                 DeepSeek-V4 mHC kernels
#   pynvvideocodec, torchcodec          video inputs of multimodal models
#   nvidia-cutlass-dsl-libs-cu12        the CUDA 12 build of the CuTe DSL (the machine runs CUDA 13;
#                                       nvidia-cutlass-dsl-libs-cu13 is carried)
# If the join's import check names one of them, fetch again with FULL=1.
#
# Known mismatches with the image, kept on purpose (the join prints them):
#   numpy   the closure asks <2.4 (mistral-common 1.13.1) and <2.5 (numba 0.65.0); the image has
#           2.5.2, which its own compiled packages were built against: a carried older numpy first
#           on PYTHONPATH would be imported by all of them. vLLM imports numba only for n-gram
#           speculative decoding and mistral_common only for Mistral tokenizers.
#   numba   vllm pins ==0.65.0; the image's (version unknown here) is used as it is.
#
# Output, all under .gpu/ (ignored by git through .git/info/exclude):
#   .gpu/vllm/wheels/        the wheels
#   .gpu/vllm/manifest.tsv   one line per wheel: name, version, sha256, bytes, file
#   .gpu/vllm/image.tsv      one line per image package: name, requirement
#   .gpu/vllm/p0 .. pN       the parts: the wheels as one tar stream cut into pieces of PART_MIB
#                            (small wheels share a part, a large one spans several); each part
#                            holds its piece (`piece`), `part.info` (index, count, the piece's
#                            sha256, the set's id) and copies of manifest.tsv and image.tsv
#   .gpu/vllm_join.sh        benchmarks/gpu/vllm_join.sh, to carry with every part
# and it prints the device calls to make, in order.
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
PYTHON=${PYTHON:-.venv/bin/python}
FULL=${FULL:-0}
OUT=.gpu/vllm
# A device call carries at most 64 MiB: the working tree, the join script and one part. The part
# gets what the tree leaves, less a margin for the tree growing before the calls are made.
CALL_MIB=64
MARGIN_MIB=2
MAX_PART_MIB=62

PLATFORMS=()
for minor in $(seq 39 -1 17); do  # the machine's Python 3.12.3 is Ubuntu 24.04's: glibc 2.39
  PLATFORMS+=(--platform "manylinux_2_${minor}_x86_64")
done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
            --platform linux_x86_64)

PACKAGES=(
  vllm==0.26.0 flashinfer-python==0.6.14
  agent-detector==2.0.0 annotated-types==0.8.0 anthropic==2.17.0 apache-tvm-ffi==0.1.10 astor==0.8.1
  blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 cffi==2.1.1 compressed-tensors==0.17.0
  cryptography==50.0.2 cuda-python==13.4.4 cuda-tile==1.7.0 depyf==0.20.0 detect-installer==0.2.1
  dill==0.4.1 dnspython==2.9.2 docstring-parser==0.18.0 email-validator==2.4.0 fastapi==0.136.3
  fastapi-cli==0.0.34 fastapi-cloud-cli==0.28.0 fastar==0.12.0 fastsafetensors==0.5.0
  googleapis-common-protos==1.76.0 httpcore2==2.17.0 httptools==0.9.0
  httpx2==2.17.0 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3
  loguru==0.7.3 mcp==2.3.0 mcp-types==2.3.0 mistral-common==1.13.1
  model-hosting-container-standards==0.1.16 msgspec==0.23.0 nvidia-cuda-nvdisasm==13.5.37
  nvidia-cudnn-frontend==1.28.0 nvidia-cutlass-dsl==4.6.0 nvidia-cutlass-dsl-libs-base==4.6.0
  nvidia-cutlass-dsl-libs-core==4.6.0 nvidia-cutlass-dsl-libs-cu13==4.6.0 nvtx==0.2.15 openai==3.63.0
  openai-harmony==0.0.8 opentelemetry-api==1.45.2 opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-semantic-conventions-ai==0.5.1
  outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0
  pybase64==1.5.1 pycountry==26.2.16 pycparser==3.12 pydantic==2.14.4 pydantic-core==2.50.5
  pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 pyjwt==2.15.1 python-dotenv==1.2.4
  python-json-logger==4.2.0 python-multipart==0.0.34 pyzmq==27.3.0 quack-kernels==0.6.3
  referencing==0.37.0 rich-toolkit==0.20.6 rignore==0.8.1 rpds-py==2026.9.1 sentry-sdk==2.76.0
  setproctitle==1.3.8 sniffio==1.3.1 sse-starlette==3.7.1 starlette==1.10.0 supervisor==4.3.0
  torch-c-dlpack-ext==0.1.5 truststore==0.10.5 typing-inspection==0.4.5 uvicorn==0.55.0
  watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.7
)
OPTIONAL=(
  tokenspeed-mla==0.1.8 tokenspeed-triton==3.9.10.post20261028 humming-kernels==0.1.10
  nvidia-cuda-nvcc==13.5.37 nvidia-nvvm==13.5.37 nvidia-cuda-crt==13.5.37 nvidia-cuda-cccl==13.3.5.0.6
  pyelftools==0.33 tilelang==0.1.9 z3-solver==4.15.4.0 pynvvideocodec==2.0.4 torchcodec==0.17.0
  nvidia-cutlass-dsl-libs-cu12==4.6.0
)
# The image's packages in vLLM 0.26.0's closure and what the closure requires of each ("any": no
# bound). The join checks each one there (installed, version within the requirement).
IMAGE='aiohappyeyeballs >=2.5.0
aiohttp >=3.13.3
aiosignal >=1.4.0
annotated-doc >=0.0.2
anyio <5,>=4.10
attrs >=22.2.0
certifi >=2023.5.7
charset-normalizer <4,>=2
click <9.0.0,>=8.4.2
cloudpickle any
cuda-bindings <14,>=13.0.3,~=13.4.4
cuda-core ~=1.2.0
cuda-pathfinder >=1.4.2,~=1.1
cuda-toolkit ==13.0.2
einops any
filelock >=3.16.1
frozenlist >=1.1.1
fsspec >=2023.5.0
grpcio <2.0.0,>=1.63.2
h11 >=0.16
hf-xet <2.0.0,>=1.6.0
httpcore ==1.*
httpx <1,>=0.27.0
huggingface-hub <2.0,>=1.5.0
idna <4,>=3.18
jinja2 >=3.1.5
llvmlite <0.48,>=0.47.0dev0
markdown-it-py >=2.2.0
markupsafe >=2.0
mdurl ~=0.1
ml-dtypes any
mpmath <1.4,>=1.1.0
multidict <8.0,>=4.5
networkx >=2.5.1
ninja any
numba ==0.65.0
numpy <2.4,>=2
nvidia-cublas ==13.1.0.3.*
nvidia-cuda-cupti ==13.0.85.*
nvidia-cuda-nvrtc ==13.0.88.*
nvidia-cuda-runtime ==13.0.96.*
nvidia-cudnn-cu13 ==9.19.0.56
nvidia-cufft ==12.0.0.61.*
nvidia-cufile ==1.15.1.6.*
nvidia-curand ==10.4.0.35.*
nvidia-cusolver ==12.0.4.66.*
nvidia-cusparse ==12.6.3.3.*
nvidia-cusparselt-cu13 ==0.8.0
nvidia-ml-py any
nvidia-nccl-cu13 ==2.28.9
nvidia-nvjitlink ==13.0.88.*
nvidia-nvshmem-cu13 ==3.4.5
nvidia-nvtx ==13.0.85.*
opencv-python-headless >=4.13.0
packaging >=24.2
pillow !=8.3.*,>=10.3.0
prometheus-client <1.0.0,>=0.18.0
propcache >=0.2.1
protobuf <7,>=6.33.5
psutil any
py-cpuinfo any
pygments <3.0.0,>=2.13.0
pyyaml >=5.1
regex >=2025.10.22
requests >=2.26.0,~=2.25
rich >=13.8.0
safetensors >=0.8.0
sentencepiece any
setuptools <81.0.0,>=77.0.3
shellingham >=1.3.0
sympy >=1.13.3
tabulate any
tiktoken >=0.7.0
tokenizers <0.24.0,>=0.23.1
torch ==2.11.0
torchaudio ==2.11.0
torchvision ==0.26.0
tqdm >=4.62.3
transformers >=5.5.3
triton ==3.6.0
typer >=0.26.1
typing-extensions <5,>=4.16.0
urllib3 <3,>=1.26.11
uvloop >=0.15.1
yarl <2.0,>=1.25.1'

grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
wanted=("${PACKAGES[@]}")
[[ $FULL == 1 ]] && wanted+=("${OPTIONAL[@]}")
rm -rf "$OUT"
mkdir -p "$OUT/wheels"
# --constraint /dev/null: the machine-wide pip constraints (/etc/xdg/pip) cap torch for this
# machine's own environment, not for wheels bound for another one.
PIP_CONSTRAINT= "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" --constraint /dev/null -d "$OUT/wheels" "${wanted[@]}" 2>&1 \
  | grep -v "^WARNING: Location 'file://" || true
count=$(ls "$OUT"/wheels/*.whl | wc -l)
if (( count != ${#wanted[@]} )); then
  echo "fetch_vllm.sh: downloaded $count wheels for ${#wanted[@]} pinned packages" >&2
  exit 1
fi

for wheel in "$OUT"/wheels/*.whl; do
  file=$(basename "$wheel")
  IFS=- read -r name version _ <<< "$file"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$version" "$(sha256sum "$wheel" | cut -d' ' -f1)" \
    "$(stat -c %s "$wheel")" "$file"
done > "$OUT/manifest.tsv"
printf '%s\n' "$IMAGE" > "$OUT/image.tsv"
set_id=$(cat "$OUT/manifest.tsv" "$OUT/image.tsv" | sha256sum | cut -c1-16)

# (a tracked file deleted in the working tree does not travel: stat's complaint about it is dropped)
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | { xargs -0 stat -c %s 2>/dev/null || true; } \
  | awk '{s += $1} END {print s}')
part_mib=$(( CALL_MIB - MARGIN_MIB - (tree_bytes + 1048575) / 1048576 ))
(( part_mib > MAX_PART_MIB )) && part_mib=$MAX_PART_MIB
# A reproducible stream (names sorted, no times or owners): the same wheel set gives the same parts,
# so a part of an earlier fetch still joins with the parts of this one.
tar -cf - --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$OUT/wheels" . | split -b "${part_mib}M" -d -a 3 - "$OUT/piece-"
pieces=("$OUT"/piece-*)
total=${#pieces[@]}
for index in "${!pieces[@]}"; do
  part=$OUT/p$index
  mkdir -p "$part"
  mv "${pieces[$index]}" "$part/piece"
  echo "$index $total $(sha256sum "$part/piece" | cut -d' ' -f1) $set_id" > "$part/part.info"
  cp "$OUT/manifest.tsv" "$OUT/image.tsv" "$part/"
done
cp benchmarks/gpu/vllm_join.sh .gpu/vllm_join.sh

wheel_bytes=$(awk -F'\t' '{s += $4} END {print s}' "$OUT/manifest.tsv")
echo "$count wheels, $(( wheel_bytes / 1048576 )) MiB, in $total parts of at most $part_mib MiB" \
     "(the tree is $(( tree_bytes / 1024 )) KiB), set $set_id:"
awk -F'\t' '{printf "  %-44s %-24s %8.1f MiB\n", $1, $2, $4 / 1048576}' "$OUT/manifest.tsv" | sort -k3 -rn | head -12
echo "  ... (all of them in $OUT/manifest.tsv)"
echo
echo "Device calls, back to back on one warm machine (it is given back when idle, and the parts with it):"
for (( index = 0; index < total; index++ )); do
  echo "  run $((index + 1))  carry [\"$OUT/p$index\", \".gpu/vllm_join.sh\"]  command: bash .gpu/vllm_join.sh $index"
done
for phase in build cua_s1 open_jev; do
  index=$((index + 1))
  echo "  run $index  carry [\".whl\"]  command: PHASE=$phase bash benchmarks/gpu/native_run.sh  timeout_s 600"
done
echo "(.whl: bash benchmarks/gpu/fetch_wheels.sh, here, first; native_run.sh's header says what each phase does)"
