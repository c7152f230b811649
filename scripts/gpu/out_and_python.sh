# Sourced by the stage scripts (after they set DRY): where results go and
# which Python runs. $OUT is set by the device tool on the GPU machine; a
# dry run here uses the project's .venv unless PYTHON says otherwise.
if [ -z "${OUT:-}" ]; then
    OUT=$(mktemp -d)
    echo "OUT was unset: writing to $OUT"
fi
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ "$DRY" = 1 ] && [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then
    PY=.venv/bin/python
fi
