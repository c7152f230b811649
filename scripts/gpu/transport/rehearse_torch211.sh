#!/usr/bin/env bash
# The torch211 plan (vLLM 0.32 on the GPU machine's own torch 2.11), its
# Python side rehearsed on this CPU machine; CI never runs it (it downloads
# about 3 GB: torch 2.11.0's CUDA build and its nvidia libraries).
#
# Builds what stage2.sh builds on the machine, as far as a machine without a
# GPU allows: a Python 3.12 environment with torch 2.11.0+cu130 and the
# machine's packages (the versions KINDS.md's pip list gives; the others
# unpinned, their version there is unknown), the plan's pieces installed by
# install_pieces.py into a --target folder, the plugin's entry point, then
# rehearse_torch211.py's two checks. vLLM's extensions link the CUDA driver
# library, which only a GPU machine has: a load-time stand-in, built here
# from the entry points they import, fails every call as NVIDIA's own stub
# library does, so nothing can run a kernel.
#
# Usage (repository root, after fetch_wheels.py has cut .gpu-wheels/torch211):
#   bash scripts/gpu/transport/rehearse_torch211.sh [WORK]   # default /tmp/kvmem-torch211
# (PIECES=folder for pieces elsewhere; PYTHON312=interpreter.)
# Exit 0 when both checks pass; the report is WORK/rehearsal.json.
set -euo pipefail
cd "$(dirname "$0")/../../.."

WORK=${1:-/tmp/kvmem-torch211}
PIECES=${PIECES:-.gpu-wheels/torch211}
# Python 3.12, the machine's: $PYTHON312, python3.12, or pyenv's (as fetch_wheels.py).
PY312=${PYTHON312:-}
for cand in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    [ -n "$PY312" ] && break
    "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && PY312=$cand
done
[ -n "$PY312" ] || { echo "no Python 3.12 found: set PYTHON312"; exit 2; }
[ -f "$PIECES/manifest.json" ] || {
    echo "no $PIECES/manifest.json: run scripts/gpu/transport/fetch_wheels.py first"
    exit 2
}
mkdir -p "$WORK"
VENV=$WORK/venv SITE=$WORK/site STUB=$WORK/driver-stub
[ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV"
PY=$VENV/bin/python
# PyPI, without this machine's constraints and wheel folders.
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1

MACHINE=(torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 numpy==2.5.2
         tokenizers==0.23.2 safetensors==0.8.0 sentencepiece==0.2.2
         tiktoken==0.14.0 huggingface_hub==1.33.0
         numba uvloop regex psutil requests tqdm py-cpuinfo protobuf aiohttp
         prometheus_client pillow pyyaml six einops cloudpickle ninja anyio
         idna attrs click rich h11 httpx certifi urllib3 annotated-doc typer
         grpcio "setuptools<81")
"$PY" -m pip install -q "${MACHINE[@]}"

rm -rf "$SITE"
"$PY" scripts/gpu/transport/install_pieces.py install --root "$PIECES" --target "$SITE" --partial
. scripts/gpu/transport/plugin_dist_info.sh
write_plugin_dist_info "$SITE"
"$PY" scripts/gpu/transport/install_pieces.py check --target "$SITE" --out "$WORK/install_check.json" \
    || true  # a finding (the machine's versions differ from the resolution's), not a stop

# The driver stand-in: every cu* entry point the extensions import.
mkdir -p "$STUB"
for so in "$SITE"/vllm/*.so "$SITE"/vllm/vllm_flash_attn/*.so; do
    nm -D --undefined-only "$so" | awk '{print $2}'
done | sed 's/@.*//' | grep -E '^cu[A-Z]' | sort -u >"$STUB/symbols.txt"
{
    echo "/* Load-time stand-in for libcuda.so.1 (CUDA_ERROR_STUB_LIBRARY). */"
    while read -r sym; do echo "int $sym(void) { return 34; }"; done <"$STUB/symbols.txt"
} >"$STUB/stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUB/libcuda.so.1" "$STUB/stub.c"
echo "driver stand-in: $(wc -l <"$STUB/symbols.txt") entry points"

set +e
LD_LIBRARY_PATH=$STUB PYTHONPATH="$SITE:$PWD" "$PY" scripts/gpu/transport/rehearse_torch211.py \
    >"$WORK/rehearsal.json"
RC=$?
set -e
cat "$WORK/rehearsal.json"
exit $RC
