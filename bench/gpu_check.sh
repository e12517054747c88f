#!/usr/bin/env bash
# The GPU check: one prepared command for a session lent the GPU machine (an H200 with JAX and
# PyTorch, no TensorFlow, no network, 64 MiB carried per call; /work/.library/device/README.md).
#
# It measures, on Keras's JAX backend with one fixed batch kept on the device (no input pipeline),
# the recipe's ResNet-50 (model, optimizer, loss: resnet_imagenet.build_model/compile_model) in a
# plain fit, the same with trainwell's per-step callbacks (NaNRollback, Checkpoint, EarlyStopping:
# issue #21's "within 2 % of the bare fit"), and keras.applications.ResNet50, at
# steps_per_execution 8 and 1, mixed float16 (bench/resnet_throughput_jax.py; its JSON has the ratios
# and the targets). TensorFlow is not on that machine, so the recipe's tf.data pipeline and train()
# itself are not run there; everything here imports without TensorFlow on JAX.
#
# Prepare here, once (downloads the Keras wheels the machine lacks into bench/.wheels, git-ignored):
#   bash bench/gpu_check.sh --fetch-wheels
# Then, in a session lent the machine (about 7 minutes):
#   run(command="bash bench/gpu_check.sh", carry=["bench/.wheels"], timeout_s=540)
# The JSON lands in $OUT/gpu_check.json (the device tool's output folder) and on stdout.
# A CPU smoke test of the same path (tiny sizes, here):  bash bench/gpu_check.sh --smoke
# Which callback of the stack costs (one member at a time, with a host profile):  bash bench/gpu_check.sh --callbacks
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=bench/.wheels

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  # The pins of constraints.txt, for the machine's Python 3.12 (pure-Python wheels, and optree's).
  pin() { grep -i "^$1==" constraints.txt; }
  mkdir -p "$WHEELS"
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" \
    "$(pin keras)" "$(pin namex)" "$(pin optree)"
  ls -l "$WHEELS"
  exit 0
fi

echo "== the machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
echo "cores: $(nproc)  python: $("$PY" -V 2>&1)"
"$PY" - <<'EOF'
import importlib
for name in ("jax", "jaxlib", "keras", "numpy", "yaml", "h5py", "optree", "namex", "ml_dtypes", "rich", "absl",
             "torch", "torchvision", "tensorflow"):
    try:
        print(f"  {name:12s} {getattr(importlib.import_module(name), '__version__', 'present')}")
    except Exception as e:  # noqa: BLE001 - report whatever stops an import
        print(f"  {name:12s} missing ({type(e).__name__})")
EOF

# Bring only what is missing: Keras 3.15.1 (with namex and optree) from the carried wheels.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import keras, sys; sys.exit(keras.__version__ != '3.15.1')" 2>/dev/null; then
  if ls "$WHEELS"/keras-*.whl >/dev/null 2>&1; then
    echo "== installing the carried wheels into /tmp/site: $(ls "$WHEELS" | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    echo "Keras 3.15.1 is not installed here and no wheels were carried: run 'bash bench/gpu_check.sh --fetch-wheels'" \
         "on the development machine, then carry bench/.wheels." >&2
    exit 2
  fi
fi
export KERAS_BACKEND=jax XLA_PYTHON_CLIENT_PREALLOCATE=false

OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if [[ "${1:-}" == "--smoke" ]]; then
  # Same path on a CPU, tiny: checks that the configurations build and run, not their speed.
  exec "$PY" bench/resnet_throughput_jax.py --batch 4 --image-size 32 --steps 4 --rounds 1 --warmup-executions 1 \
    --configs recipe-f32-spe2,recipe-f32-spe2+stack,apps-f32-spe2 --out "$OUT/gpu_check_smoke.json"
fi
if [[ "${1:-}" == "--callbacks" ]]; then
  # Which callback costs: the bare recipe, each member of the stack alone and the whole stack, at spe 8 and 1,
  # one round each, then one more round of each '+' configuration under cProfile (about 6 minutes).
  exec timeout 480 "$PY" bench/resnet_throughput_jax.py --steps 48 --rounds 1 --budget-s 420 --host-profile \
    --configs recipe-mixed-spe8,recipe-mixed-spe8+stack,recipe-mixed-spe1,recipe-mixed-spe1+nan,recipe-mixed-spe1+ckpt,recipe-mixed-spe1+stack \
    --out "$OUT/gpu_callbacks.json"
fi
echo "== ResNet-50, mixed float16, batch 256, 224 px (JSON also in $OUT/gpu_check.json)"
exec timeout 480 "$PY" bench/resnet_throughput_jax.py --steps 48 --rounds 2 --budget-s 420 \
  --configs recipe-mixed-spe8,recipe-mixed-spe8+stack,apps-mixed-spe8,recipe-mixed-spe1,recipe-mixed-spe1+stack \
  --out "$OUT/gpu_check.json"
