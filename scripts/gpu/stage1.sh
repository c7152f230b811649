#!/usr/bin/env bash
# Stage 1 of issue 17 on the GPU machine, in ONE device call: the copy
# engine's CUDA tests (plain PyTorch, no vLLM), the transfer benchmark on
# CUDA, the torch 2.13 symbol check against the machine's CUDA libraries, and
# the machine's real package list. Ran on an NVIDIA H200 on 2026-11-26.
# A wheel piece carried along (.gpu-wheels*/<plan>/pNNN) is first copied out
# of the checkout into /tmp/kvmem-pieces (install_pieces.py take): the next
# call's carried path replaces the whole .gpu-wheels folder here.
# Everything it prints also goes to $OUT/stage1.log; at most 8 files come
# back from $OUT (GPU = h100, h200, ... from nvidia-smi):
#
#   stage1.log          all output
#   stage1_pytest.xml   JUnit report of the test run
#   transfer_GPU.json   benchmarks/transfer_bench.py, labelled GPU with the
#   transfer_GPU.png      device (commit under benchmarks/results/)
#   abi_machine.json    abi_check.py machine: torch 2.13's needs vs these libs
#   pip_freeze.txt      the machine's packages (fetch_wheels.py --machine-packages)
#   machine.txt         GPU, driver, glibc, torch/CUDA/cuDNN/NCCL/Triton versions
#
# Usage (from the repository root):
#   bash scripts/gpu/stage1.sh             # on the GPU machine ($OUT set by the tool)
#   bash scripts/gpu/stage1.sh --dry-run   # anywhere: CPU, tiny sizes, tests collected only
set -u
cd "$(dirname "$0")/../.."

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
. scripts/gpu/out_and_python.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/stage1.log") 2>&1

declare -A RC
step() {  # step NAME TIMEOUT_S CMD...: run, record the exit status, go on
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
    local t0=$SECONDS
    if declare -F "$1" >/dev/null; then "$@"; else timeout "$limit" "$@"; fi
    RC[$name]=$?
    echo "=== $name: exit ${RC[$name]} after $((SECONDS - t0)) s"
}

echo "stage 1 $( [ "$DRY" = 1 ] && echo DRY RUN ) at $(date -u +%FT%TZ) in $PWD, python $PY"
# Outputs are named after the GPU that runs them: h100, h200, ... ("cpu": none).
GPU=$("$PY" scripts/gpu/gpu_common.py suffix)
echo "GPU: $GPU"

take_pieces() {  # copy any carried piece folder out of the checkout
    local d found=0
    for d in .gpu-wheels*/*/; do
        ls -d "$d"p[0-9]* >/dev/null 2>&1 || continue
        found=1
        if [ "$DRY" = 1 ]; then
            echo "would run: install_pieces.py take ${d%/}"
        else
            "$PY" scripts/gpu/transport/install_pieces.py take "${d%/}"
        fi
    done
    [ "$found" = 1 ] || echo "no piece carried in this call"
    return 0  # pieces still missing are the next calls', not a failure
}
step pieces 60 take_pieces

machine_info() {
    {
        echo "# uname"; uname -a
        echo "# glibc"; ldd --version 2>&1 | head -1
        echo "# nvidia-smi"; nvidia-smi 2>&1 | head -20
        echo "# python"
        "$PY" - <<'EOF'
import platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
    print("cudnn", torch.backends.cudnn.version())
    try:
        print("nccl", torch.cuda.nccl.version())
    except Exception as exc:
        print("nccl ?", exc)
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print("triton: not importable", exc)
EOF
    } >"$OUT/machine.txt" 2>&1
    cat "$OUT/machine.txt"
}
step machine 45 machine_info
step pip_freeze 45 bash -c "'$PY' -m pip freeze >'$OUT/pip_freeze.txt' && wc -l '$OUT/pip_freeze.txt'"

TESTS=(tests/test_copy_engine_cuda.py tests/test_host_pool.py tests/test_wait_timer.py
       tests/test_copy_engine.py)
# test_host_pool's 'vllm' stand-ins read vLLM's CudaRTLibrary: not here in
# stage 1 (test_copy_engine_cuda.py checks torch's bindings on the real GPU).
PYTEST=("$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" -k "not vllm"
        --deselect tests/test_host_pool.py::test_stand_ins_offer_exactly_what_the_real_runtimes_offer
        --junitxml "$OUT/stage1_pytest.xml")
if [ "$DRY" = 1 ]; then
    # Collected only; test_copy_engine.py (which imports vLLM here) left out.
    # (Dropped from the array, not blanked: an empty argument would make
    # pytest collect the whole repository.)
    DRY_PYTEST=()
    for arg in "${PYTEST[@]}"; do
        [ "$arg" = tests/test_copy_engine.py ] || DRY_PYTEST+=("$arg")
    done
    step pytest 300 "${DRY_PYTEST[@]}" --collect-only
    step transfer_bench 300 "$PY" benchmarks/transfer_bench.py --device cpu --quick \
        --iters 1 --pageable --overlap --shapes 8b --out "$OUT/transfer_cpu_dryrun.json"
    echo "would write: $OUT/transfer_$GPU.json (+ .png), labelled by gpu_common.py label"
else
    # Limits that keep the call within 7 minutes of a 15-minute session
    # (scripts/gpu/README.md); a step over its limit is recorded and skipped.
    step pytest 120 "${PYTEST[@]}" -rs --durations=10
    step transfer_bench 150 "$PY" benchmarks/transfer_bench.py --device cuda \
        --iters 5 --warmup 1 --pageable --overlap --out "$OUT/transfer_$GPU.json"
    # platform GPU, a label with the device and the date (data unchanged)
    [ -f "$OUT/transfer_$GPU.json" ] && "$PY" scripts/gpu/gpu_common.py label \
        "$OUT/transfer_$GPU.json" --command "bash scripts/gpu/stage1.sh"
fi
step abi_machine 60 "$PY" scripts/gpu/transport/abi_check.py machine \
    --needs scripts/gpu/transport/abi_needs.json --out "$OUT/abi_machine.json"

echo
echo "=== summary"
FAIL=0
for name in machine pip_freeze pytest transfer_bench abi_machine; do
    echo "$name: exit ${RC[$name]:-not run}"
    # abi_machine exits 1 when a library lacks a symbol: a finding, not a failure.
    if [ "$name" != abi_machine ] && [ "${RC[$name]:-1}" != 0 ]; then FAIL=1; fi
done
ls -la "$OUT"
exit $FAIL
