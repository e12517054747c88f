#!/bin/bash
# bench/input_pipeline.py on growing slices of the machine's cores (taskset), one JSON per slice.
#
# Usage: bash bench/input_pipeline_cores.sh OUT_DIR [PYTHON] [CORE_SLICES...]
#   OUT_DIR      where ip_cores_<slice>.json and .log go (created)
#   PYTHON       the interpreter that imports tensorflow and trainwell (default: python3)
#   CORE_SLICES  taskset CPU lists (default: 0-1 0-3 and 0-<last core>)
# Example (the 16-core GPU host of the README): bash bench/input_pipeline_cores.sh /tmp/ip python3
set -euo pipefail
out=${1:?"usage: $0 OUT_DIR [PYTHON] [CORE_SLICES...]"}
py=${2:-python3}
shift $(( $# >= 2 ? 2 : 1 ))
slices=("$@")
if [ ${#slices[@]} -eq 0 ]; then
  last=$(( $(nproc --all) - 1 ))
  slices=(0-1 0-3 "0-$last")
fi
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
for s in "${slices[@]}"; do
  echo "== cores $s" >&2
  # 1000 images, so that a pass over them lasts long enough on many cores; 3 epochs a round
  # on the widest slice, 2 on the others (the naive pipeline's pass is the long one).
  epochs=2; [ "$s" = "${slices[-1]}" ] && epochs=3
  taskset -c "$s" "$py" "$here/input_pipeline.py" --images 1000 --epochs-per-round $epochs \
    > "$out/ip_cores_$s.json" 2> "$out/ip_cores_$s.log" || { tail -20 "$out/ip_cores_$s.log" >&2; exit 1; }
  cat "$out/ip_cores_$s.json"; echo
done
