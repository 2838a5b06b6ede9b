#!/usr/bin/env bash
# Issue 54's GPU figures in one call (about 6-8 minutes on one H100), from the repository root:
#
#     bash benchmarks/gpu_check.sh          # both depths; or `2` / `4` for one
#     bash benchmarks/gpu_check.sh whole    # issue 68 point 3: Qwen3-30B-A3B's 48 layers, LoRA, one GPU (<= 9 min)
#     bash benchmarks/gpu_check.sh sweeps   # issue 68 point 2: runs per hour of the main job at --parallel 1,2,4,8 (<= 6 min)
#
# `python -m benchmarks.run --only real --only loop` at the real dims' 2 layers (the issue's loop
# figures: rollout per decode step against the bare step, update per token against the isolated
# train step, drift's share, the first iteration with the compilation cache filled) and again at
# `--real-layers 4` (the deeper proxy's TFLOP/s and MFU against the measured and the spec peak).
# Each run writes benchmarks/results-<device>[-4layers].json (device, versions, command, commit);
# those and each run's log are copied into $OUT (./gpu-out without it). Nothing is installed: a
# package the image lacks is taken from this checkout's .venv where it is there (carry e.g.
# .venv/lib/python3.12/site-packages/ml_collections, pure Python), else named and the run stops.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# A cap on JAX's GPU memory pool, not a preallocation change: headroom for the 4-layer run's state.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

need="jax jaxlib flax optax orbax.checkpoint chex ml_collections numpy ml_dtypes absl yaml safetensors pyarrow transformers matplotlib tqdm"
optional="tensorboardX math_verify"  # imported only where present (metrics files, GSM8K's second check)
missing() { $PY -c "
import importlib, sys
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as e:
        print(m)
" "$@" 2>/dev/null; }
gone=$(missing $need $optional)
if [ -n "$gone" ]; then  # link what the checkout's .venv holds of them, and only that, into the path
    extra=/tmp/gspo_extra_site
    mkdir -p "$extra"
    for m in $gone; do
        top=${m%%.*}
        for d in .venv/lib/python3*/site-packages/"$top"; do
            [ -e "$d" ] && ln -sfn "$PWD/$d" "$extra/$top" && echo "using $top from $d"
        done
    done
    export PYTHONPATH="$extra${PYTHONPATH:+:$PYTHONPATH}"
fi
gone=$(missing $need | tr '\n' ' ')
if [ -n "$gone" ]; then
    echo "missing Python packages (required): $gone" | tee "$OUT/missing.txt"
    echo "carry them (pure Python: .venv/lib/python3.12/site-packages/<name>) or as wheels; nothing was run"
    exit 3
fi
opt=$(missing $optional | tr '\n' ' ')
[ -n "$opt" ] && echo "missing optional packages (the runs go on without them): $opt"

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $PY -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, \
'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
} 2>&1 | tee "$OUT/env.txt"

marker=$(mktemp)
status=0
run() {  # name, time limit in seconds, then the runner's arguments
    local name=$1 limit=$2
    shift 2
    echo "== $name: python -m benchmarks.run $* (at most $limit s)"
    local t0=$SECONDS
    timeout "$limit" $PY -m benchmarks.run "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || status=$rc
}
case ${1:-all} in 2 | all) run layers2 270 --only real --only loop ;; esac
case ${1:-all} in 4 | all) run layers4 300 --only real --only loop --real-layers 4 ;; esac
if [ "${1:-all}" = whole ]; then  # batches 64 then 32 (WHOLE_BATCHES), each try in a child under 260 s
    echo "== whole: python -m benchmarks.whole_model (at most 540 s)"
    timeout 540 $PY -m benchmarks.whole_model --batches "${WHOLE_BATCHES:-64,32}" --iterations 2 --limit 260 2>&1 | tee "$OUT/whole.log"
    rc=${PIPESTATUS[0]}
    echo "== whole: exit $rc"
    [ "$rc" = 0 ] || status=$rc
fi
if [ "${1:-all}" = sweeps ]; then  # 40-iteration runs (SWEEP_ITERATIONS), projected to the config's 200
    echo "== sweeps: python -m benchmarks.sweep_throughput (at most 360 s)"
    timeout 360 $PY -m benchmarks.sweep_throughput --iterations "${SWEEP_ITERATIONS:-40}" 2>&1 | tee "$OUT/sweeps.log"
    rc=${PIPESTATUS[0]}
    echo "== sweeps: exit $rc"
    [ "$rc" = 0 ] || status=$rc
fi
# Each runner writes its JSON after every section, try or wave: a run stopped by its limit leaves what it measured.
find benchmarks -maxdepth 1 \( -name 'results-*.json' -o -name 'whole_model-*.json' -o -name 'sweep_throughput-*.json' \) -newer "$marker" -exec cp {} "$OUT"/ \;
rm -f "$marker"
ls -l "$OUT"
exit $status
