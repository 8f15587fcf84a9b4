#!/usr/bin/env bash
# Build the wheels a GPU machine (nvidia-h100-x1 / nvidia-h200: Python 3.12, torch 2.11+cu130,
# no internet) lacks for yattflow, into DIR (default .whl), so that a `device` run can carry them.
#
#   bench/gpu_wheels.sh [DIR] [EXTRA_REQUIREMENT ...]
#   echo /.whl/ >> .git/info/exclude          # once: the folder travels only when carried
#   device run, carry [".whl"], command:
#     python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl \
#       && export PYTHONPATH=$PWD:$PWD/.site && python3 -m pytest -m gpu ...
#
# Run it from the project's root: it reads the pins of requirements/*.lock. It resolves the project's
# runtime requirements for CPython 3.12 / manylinux x86_64, drops every
# package the GPU image already has (gpu_image_packages.txt beside this file; torch, CUDA, triton among
# them), downloads the rest without dependencies, and fails if they exceed 56 MiB (a run carries
# 64 MiB in all). s3fs and its botocore (~15 MB) are left out unless named as an extra.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-.whl}; shift || true
# The project's own pins where it has lock files (run from its root): the runtime set CI tests, so the
# GPU run uses the same versions (transformers and peft too, although the image has older ones).
pin(){ grep -hiE "^$1==" requirements/base.lock requirements/engines.lock 2>/dev/null | head -1 | cut -d' ' -f1; }
reqs=()
for n in prefect fastapi sqlalchemy pydantic transformers tokenizers safetensors peft math-verify setproctitle megatron-core; do
  v=$(pin "$n"); [ -n "$v" ] && reqs+=("$v"); done
[ ${#reqs[@]} -gt 0 ] || reqs=("prefect==3.8.8" "fastapi<0.151" "sqlalchemy[asyncio]<2.1" "pydantic>=2.6" "megatron-core==0.16.1")
keep=$(printf '%s\n' "${reqs[@]}" | sed -E 's/[=<>\[].*//' | tr 'A-Z_.' 'a-z--' | tr '\n' ' ')
reqs+=("$@")
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any)
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux2010_x86_64 manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  plat+=(--platform "$p"); done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip install -q --dry-run --ignore-installed --ignore-requires-python --target "$tmp/t" \
  --report "$tmp/report.json" "${plat[@]}" "${reqs[@]}" 2> >(grep -v '^WARNING: Location' >&2)
python3 - "$tmp/report.json" "$here/gpu_image_packages.txt" "$keep" > "$tmp/pins" <<'EOF'
import json, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(l.strip()) for l in open(sys.argv[2]) if l.strip() and not l.startswith("#")}
keep = set(sys.argv[3].split())  # pinned by the project: carried even where the image has another version
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    n = norm(name)
    if (n in have and n not in keep) or n.startswith(("nvidia-", "cuda-")) or n in {"torch", "triton"}:
        continue
    print(f"{name}=={version}")
EOF
mkdir -p "$out"
python3 -m pip download -q --no-deps -d "$out" "${plat[@]}" -r "$tmp/pins" 2> >(grep -v '^WARNING: Location' >&2)
size=$(du -sm "$out" | cut -f1)
echo "wheels: $(ls "$out"/*.whl | wc -l) in $out, ${size} MiB"
[ "$size" -le 56 ] || { echo "over 56 MiB: a device run carries 64 MiB in all; drop extras" >&2; exit 1; }
