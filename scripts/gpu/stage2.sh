#!/usr/bin/env bash
# Stage 2 of issue 17 on the GPU machine: vLLM 0.32 with the plugin.
# Items a and g ran on an NVIDIA H200 on 2026-11-26 (b-f and h-j have not run).
#
# Runs after every piece has arrived (scripts/gpu/README.md): installs the
# wheels from the piece store (/tmp/kvmem-pieces, where every call that
# carried a piece copied it: install_pieces.py take) into .gpu-site (once;
# kept while the machine stays warm), makes the plugin's entry point visible
# to vLLM, checks requirements, probes the import, then runs items a-e of the
# issue (scripts/gpu/stage2.py), f (Ray, issue 19), g (issue 30's A/B,
# scripts/gpu/ab_offload.py), h (issue 36's real-size run,
# scripts/gpu/real_size.py), i (issue 42's late-spill check under Model
# Runner V1 and V2, scripts/gpu/late_spill.py) and j (issue 47's KV events
# and disk hits on CUDA, scripts/gpu/events_disk.py) when asked. Every engine
# and server here runs
# with VLLM_USE_FLASHINFER_SAMPLER=0 (gpu_common.SERVER_ENV: vLLM 0.32's
# sampler otherwise imports flashinfer, which is not carried, and every
# engine failed at start on the H200). Files in $OUT (8 at most; GPU = h100,
# h200, ... from nvidia-smi):
#
#   stage2.log            all output
#   install_check.json    install_pieces.py check: unmet requirements
#   stage2_probe.txt      versions, CUDA libraries actually loaded
#   stage2_results.json   items a-f, how g-j ended (accumulates over calls)
#   stage2_logs.tar.gz    each engine's output, g's and h's server and client logs
#   ab_offload_GPU.json   item g's figures, GPU-labelled
#   real_size_GPU.json    item h's figures, GPU-labelled
#   late_spill_GPU.json   item i's figures, GPU-labelled
#   events_disk_GPU.json  item j's figures, GPU-labelled
#
# Usage (repository root):
#   bash scripts/gpu/stage2.sh [--vllm 0.32.0|0.33.0] [--plan torch211|core] [--items abcde]
#   bash scripts/gpu/stage2.sh --items g [--ab-args '--arms none,tier,simple_lazy,offloading']
#   bash scripts/gpu/stage2.sh --items h [--real-args '--max-wall-s 480']
#   bash scripts/gpu/stage2.sh --items i [--late-args '--max-wall-s 300']
#   bash scripts/gpu/stage2.sh --items j [--events-args '--arms tier_disk,control']
#   bash scripts/gpu/stage2.sh --dry-run     # anywhere: plan and checks only
#
# --vllm picks the release: its pieces come from .gpu-wheels (0.32.0) or
# .gpu-wheels-VERSION (fetch_wheels.py --vllm VERSION; 0.33.0 carries torch
# 2.14.0), and install into their own .gpu-site(-VERSION). --plan is the
# size report's: torch211 (the default, the one plan that fits a 15-minute
# session) from its own pieces, or from the head of the core plan's stream.
set -u
cd "$(dirname "$0")/../.."

DRY=0 PLAN=torch211 ITEMS=abcde PARTIAL= VLLM=0.32.0 AB_ARGS= REAL_ARGS= LATE_ARGS= EVENTS_ARGS=
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY=1 ;;
        --vllm) VLLM=$2; shift ;;
        --plan) PLAN=$2; shift ;;
        --items) ITEMS=$2; shift ;;
        --ab-args) AB_ARGS=$2; shift ;;
        --real-args) REAL_ARGS=$2; shift ;;
        --late-args) LATE_ARGS=$2; shift ;;
        --events-args) EVENTS_ARGS=$2; shift ;;
        *) echo "unknown argument $1"; exit 2 ;;
    esac
    shift
done
case $PLAN in
    torch211|core) ;;
    *) echo "--plan $PLAN: torch211 or core (scripts/gpu/transport/size_report.md)"; exit 2 ;;
esac
case $VLLM in
    0.32.0) SUFFIX= ;;
    0.33.0) SUFFIX=-$VLLM ;;
    *) echo "--vllm $VLLM: the recipe carries 0.32.0 or 0.33.0"; exit 2 ;;
esac
. scripts/gpu/out_and_python.sh
SITE=$PWD/.gpu-site$SUFFIX
INSTALL=scripts/gpu/transport/install_pieces.py
CARRIED=.gpu-wheels$SUFFIX/$PLAN
store() {  # the store's folder for a carried plan folder (install_pieces.store_for)
    "$PY" -c 'import sys; sys.path.insert(0, "scripts/gpu/transport")
from install_pieces import store_for; print(store_for(sys.argv[1]))' "$1"
}
PIECES=$(store "$CARRIED")
if [ "$PLAN" = torch211 ] && [ ! -d "$PIECES" ] && [ ! -d "$CARRIED" ]; then
    # vLLM on the machine's own torch 2.11 from the core plan's pieces: its
    # wheels come first in that stream, so they install from those arrived.
    CARRIED=.gpu-wheels$SUFFIX/core PARTIAL=--partial
    PIECES=$(store "$CARRIED")
fi
# Why: vLLM 0.32's sampler imports flashinfer at engine start unless told not
# to, and the recipe carries no flashinfer (gpu_common.SERVER_ENV). stage2.py,
# ab_offload.py and real_size.py set it for their engines too.
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
exec > >(tee -a "$OUT/stage2.log") 2>&1
echo "stage 2 $( [ "$DRY" = 1 ] && echo DRY RUN ) vLLM $VLLM plan $PLAN items $ITEMS at $(date -u +%FT%TZ)"
echo "GPU: $("$PY" scripts/gpu/gpu_common.py suffix); VLLM_USE_FLASHINFER_SAMPLER=$VLLM_USE_FLASHINFER_SAMPLER"

if [ "$DRY" = 1 ]; then
    "$PY" "$INSTALL" --help >/dev/null && echo "install_pieces.py: ok"
    "$PY" scripts/gpu/stage2.py --dry-run --items "$ITEMS" --ab-args "$AB_ARGS" \
        --real-args "$REAL_ARGS" --late-args "$LATE_ARGS" --events-args "$EVENTS_ARGS" \
        --out "$OUT" || exit 1
    echo "would run: install_pieces.py take $CARRIED (if carried in this call)"
    echo "would run: install_pieces.py install --root $PIECES --target $SITE $PARTIAL"
    echo "would run: install_pieces.py check --target $SITE"
    echo "would run: series_tree.py take (if .gpu-site-intree/series was carried)"
    echo "would run: stage2.py --items $ITEMS --ab-args \"$AB_ARGS\" --real-args \"$REAL_ARGS\" --late-args \"$LATE_ARGS\" --events-args \"$EVENTS_ARGS\" --out \$OUT (PYTHONPATH=$SITE:$PWD)"
    exit 0
fi

if [ ! -f "$SITE/kvmem-installed.json" ]; then
    # A piece carried with this call too (the store keeps the earlier ones).
    [ -d "$CARRIED" ] && "$PY" "$INSTALL" take "$CARRIED"
    "$PY" "$INSTALL" install --root "$PIECES" --target "$SITE" $PARTIAL \
        || { echo "install failed"; exit 1; }
fi
if [ "$PLAN" = torch211 ]; then
    # vLLM's torch pin is not met on purpose: keep the machine's torch 2.11.
    rm -rf "$SITE"/torch "$SITE"/torch-*.dist-info "$SITE"/torchvision* "$SITE"/nvidia*
fi

. scripts/gpu/transport/plugin_dist_info.sh
write_plugin_dist_info "$SITE"
# The in-tree series' patches, when a call carried them (series_tree.py
# prepare: for a machine without git), out of the checkout before the next
# call's carried path replaces them; item i and item h's series arm read them.
[ -d .gpu-site-intree/series ] && "$PY" scripts/gpu/series_tree.py take
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1

"$PY" "$INSTALL" check --target "$SITE" --out "$OUT/install_check.json"

"$PY" - >"$OUT/stage2_probe.txt" 2>&1 <<'EOF'
import importlib.metadata as md
import torch
print("torch", torch.__version__, torch.__file__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
torch.zeros(1, device="cuda")  # loads the CUDA libraries
import vllm
print("vllm", vllm.__version__, vllm.__file__)
print("plugins", [e.value for e in md.entry_points(group="vllm.general_plugins")])
for name in ("triton", "transformers", "numpy", "flash_attn", "xgrammar"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"), getattr(mod, "__file__", "?"))
    except Exception as exc:
        print(name, "not importable:", exc)
import vllm._custom_ops  # noqa: F401  (the compiled extensions load)
from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401
print("vllm extensions: imported")
libs = sorted({line.split()[-1] for line in open("/proc/self/maps")
               if any(k in line for k in ("libcublas", "libcudnn.so", "libnccl",
                                          "libcudart", "libcusparseLt", "libnvrtc"))})
print("loaded CUDA libraries:", *libs, sep="\n  ")
EOF
cat "$OUT/stage2_probe.txt"
grep -q "^vllm $VLLM " "$OUT/stage2_probe.txt" \
    || { echo "stage 2 asked for vLLM $VLLM; the probe above found another"; exit 1; }

"$PY" scripts/gpu/stage2.py --items "$ITEMS" --ab-args "$AB_ARGS" --real-args "$REAL_ARGS" \
    --late-args "$LATE_ARGS" --events-args "$EVENTS_ARGS" --out "$OUT"
RC=$?
ls -la "$OUT"
exit $RC
