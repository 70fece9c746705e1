#!/usr/bin/env bash
# Set up and run benchmarks/gpu_checks.py on a lent GPU machine, which gets a copy of this
# working tree and has its own python3 with torch (maybe without our other dependencies, and
# maybe without internet).
#
#   bash benchmarks/gpu_checks.sh [gpu_checks.py options]    (default: --device cuda)
#
# Reports (gpu_checks.json, gpu_checks.log) go to $OUT when set, else ./gpu_checks_out.
# PYTHON picks the interpreter (default python3). Exit code: gpu_checks.py's (1: a check
# failed), or 2 when the machine cannot run the checks at all (it says what is missing).
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--device cuda)

say() { echo "gpu_checks.sh: $*"; }

# 1. torch, as the machine has it; installing one needs the network (often absent there).
if ! "$PY" -c "import torch" 2>/dev/null; then
    say "$PY has no torch; trying pip install torch (needs the network)"
    "$PY" -m pip install -q --retries 1 --timeout 10 torch || { say "MISSING: torch for $PY (no wheel reachable); install a CUDA build of torch"; exit 2; }
fi
"$PY" - <<'EOF' || exit 2
import torch
print(f"gpu_checks.sh: torch {torch.__version__} (CUDA build {torch.version.cuda}), "
      f"cuda available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")
EOF
case " ${args[*]} " in
    *" --device cpu "*) ;;
    *)  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
            say "MISSING: a GPU torch can use (torch.cuda.is_available() is False); nvidia-smi says:"
            nvidia-smi -L 2>&1 | head -3
            exit 2
        fi ;;
esac

# 2. What workbench's core imports besides torch; pip may fetch a missing one if online.
for module in accelerate safetensors numpy; do
    if ! "$PY" -c "import $module" 2>/dev/null; then
        say "$module missing; trying pip install $module"
        "$PY" -m pip install -q --retries 1 --timeout 10 "$module" || { say "MISSING: $module for $PY (no network?)"; exit 2; }
    fi
done

# 3. workbench itself: gpu_checks.py puts this tree first on PYTHONPATH, so an install is only
# a convenience; offline, without build isolation (no nested venv either: one made from a
# venv's python would not see that venv's torch).
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
    say "pip install -e . failed; running from the tree (PYTHONPATH) instead"
fi

# 4. The checks.
export PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_checks.py "${args[@]}" --out "${OUT:-gpu_checks_out}"
