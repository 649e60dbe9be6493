#!/usr/bin/env bash
# Everything that needs a GPU, in one go (the CPU suite cannot reach these paths): the offload engine's tests on
# CUDA (device tier = GPU memory checked with torch.cuda.memory_allocated, host tier = pinned RAM, copies on side
# streams), a training run through the CLI on each engine, and the overhead / offload benchmarks on the GPU.
#
#   bash benchmarks/gpu_check.sh [LOG_DIR]        # on a machine with one CUDA GPU and torch installed
#
# PARTS (default "tests cli bench") picks parts; PY (default python3) the interpreter. Each part has its own
# time limit so a hang in one still reports the others. Logs and benchmark JSON go to LOG_DIR (default
# runs/gpu-check).
set -u
LOG=${1:-runs/gpu-check}
PY=${PY:-python3}
PARTS=${PARTS:-tests cli bench}
mkdir -p "$LOG"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
part() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "== $name" | tee -a "$LOG/summary.txt"
  timeout "$secs" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  tail -n 4 "$LOG/$name.log" | sed 's/^/   /' | tee -a "$LOG/summary.txt"
  echo "   rc=$rc" | tee -a "$LOG/summary.txt"
  [ $rc -eq 0 ] || status=1
}

$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$LOG/summary.txt"

for p in $PARTS; do case $p in
  tests)
    part tests-offload 300 env STRATUM_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider --timeout 300 \
      tests/test_offload_engine.py -rf ;;
  cli)
    part cli-plain 60 $PY -m stratum train --set "train.device='cuda'" --set train.steps=30 \
      --set "train.out_dir='$LOG/plain'"
    part cli-offload 90 $PY -m stratum train --set "train.device='cuda'" --set train.steps=30 \
      --set "train.engine='offload'" --set "offload.device_budget='25MB'" --set "train.out_dir='$LOG/offload'"
    part cli-plan 60 $PY -m stratum plan --set "train.device='cuda'" --set "model.preset='gpt2-774m'" \
      --set "offload.device_budget='3GB'" ;;
  bench)
    for mode in overhead offload; do
      part "bench-$mode" 240 $PY benchmarks/offload_bench.py "$mode" --device cuda --preset gpt2-124m \
        --micro-batch 8 --seq-len 1024 --steps 12 --warmup 3 --set "train.precision='bf16'" \
        --out "$LOG/offload_${mode}_gpu.json"
    done ;;
esac; done
exit $status
