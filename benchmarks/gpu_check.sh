#!/usr/bin/env bash
# Everything issue 20 asks of a GPU, in parts that each fit one 10-minute command of the device tool; docs/gpu.md is
# the runbook (which `run` call runs which part, in what order, and how to read the results).
#
#   bash benchmarks/gpu_check.sh PART...       # on a machine with one CUDA GPU and torch (python3 there has it)
#   DEVICE=cpu PY=.venv/bin/python bash benchmarks/gpu_check.sh all   # the CPU dry run: every part, tiny sizes
#
# A session's device time (15 minutes, the machine's start included) fits two calls: `session`, then `session2`.
#   session           facts, the engine's core CUDA tests (test_offload_engine, _mixed), then overhead and offload25
#                     at $SESSION_TOKENS tokens a step, $SESSION_STEPS timed steps: about 6 minutes in all
#   session2          the other CUDA tests, then capacity-offload at $SESSION_CAP_TOKENS tokens a step
# The parts they are made of, and the full-size ones (each a call of its own, where more device time is lent):
#   check             torch/CUDA/machine facts, then the offload tests with STRATUM_TEST_DEVICE=$DEVICE
#   overhead          no budget, $PRESET at the largest micro-batch that fits plain (goal >= 0.97x plain)
#   offload25         device budget 25 % of the training state, same batch (goal >= 0.9x plain)
#   capacity-offload  the offload engine on $CAP_OFFLOAD with the GPU, host RAM and disk as tiers (goal: >= 30 % MFU)
#   capacity-plain    the largest of $CAP_PLAIN the plain engine trains
#   cli               short `stratum train` runs: plain, offload 25 %, bf16 chunks, fp16; `stratum plan` of 774M
#   sweep             a sharded-lrtf sweep of 6 jobs on 2 slots of the one device (issue 18)
#   multiplex         a foreground job (train.priority = foreground: the highest CUDA stream priority) and a
#                     background job on the one GPU, alone and together (issue 19); again under MPS where the
#                     machine has nvidia-cuda-mps-control and lets this user start it
#   facts, tests-core, tests-rest   check's pieces: the facts, the core test files, the other test files
#   all               check, then every part from overhead on, in that order
# Every step of a part (a part's one command, or each of cli's and check's) runs under its own time limit
# (T_<step> seconds, dashes as underscores: T_tests_offload, T_cli_fp16), so a hang in one still leaves the
# others' results. Logs, JSON and train runs go to $LOG; $OUT (the folder the device tool brings back,
# at most 8 files) gets summary.txt and gpu-check.tar.gz (all of $LOG but checkpoints), both rewritten after
# every part. Sizes come from the environment (defaults below: the GPU's, or tiny ones with DEVICE=cpu).
set -u
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
LOG=${LOG:-runs/gpu-check}
OUT=${OUT:-runs/gpu-check-out}
if [ "$DEVICE" = cpu ]; then  # the dry run: every command line end to end, in seconds
  : "${PRESET:=mini}" "${SEQ:=64}" "${TOKENS:=512}" "${STEPS:=2}" "${WARMUP:=1}" "${MAX_MICRO:=4}"
  : "${CLI_PRESET:=mini}" "${CLI_STEPS:=3}" "${CLI_MICRO:=2}" "${CLI_SEQ:=64}"
  : "${PLAN_PRESET:=mini}" "${PLAN_MICRO:=2}" "${PLAN_SEQ:=64}"
  : "${CAP_OFFLOAD:=tiny}" "${CAP_PLAIN:=tiny}" "${CAP_SEQ:=64}" "${CAP_MICRO:=2}" "${CAP_TOKENS:=256}"
  : "${CAP_STEPS:=2}" "${DEVICE_BUDGET:=64MB}" "${PYTEST_ARGS:=--collect-only}" "${DISK_DIR:=$LOG/disk}"
  : "${SWEEP_BUDGET:=8MB}" "${SWEEP_MEMORY:=24MB}" "${SWEEP_STEPS:=3}"  # memory: 2 running + 1 staged, no more
  : "${MPLEX_FG:=mini}" "${MPLEX_BG:=tiny}" "${MPLEX_SEQ:=32}" "${MPLEX_BATCH:=4}" "${MPLEX_STEPS:=6}"
  : "${PRECISION:=fp32}"  # a CPU's bf16 matrix products are slow to measure; the GPU runs bf16
else
  : "${PRESET:=gpt2-774m}" "${SEQ:=1024}" "${TOKENS:=262144}" "${STEPS:=5}" "${WARMUP:=2}" "${MAX_MICRO:=64}"
  : "${CLI_PRESET:=small}" "${CLI_STEPS:=30}" "${CLI_MICRO:=8}" "${CLI_SEQ:=256}"
  : "${PLAN_PRESET:=gpt2-774m}" "${PLAN_MICRO:=4}" "${PLAN_SEQ:=1024}"
  : "${CAP_OFFLOAD:=gpt-6.7b}" "${CAP_PLAIN:=gpt-2.7b,gpt-6.7b}" "${CAP_SEQ:=2048}" "${CAP_MICRO:=8}"
  : "${CAP_TOKENS:=262144}" "${CAP_STEPS:=3}" "${DEVICE_BUDGET:=auto}" "${PYTEST_ARGS:=-n 8}"
  : "${SWEEP_BUDGET:=160MB}" "${SWEEP_MEMORY:=480MB}" "${SWEEP_STEPS:=20}"  # every waiting job gives back
  : "${MPLEX_FG:=gpt2-124m}" "${MPLEX_BG:=small}" "${MPLEX_SEQ:=512}" "${MPLEX_BATCH:=16}" "${MPLEX_STEPS:=60}"
fi
MICRO=${MICRO:-0}                                   # 0: the largest power of two the plain engine trains
SESSION_TOKENS=${SESSION_TOKENS:-$((TOKENS / 4))}   # session's benchmarks: a quarter of the seeds' step, fewer steps
SESSION_STEPS=${SESSION_STEPS:-3}
SESSION_CAP_TOKENS=${SESSION_CAP_TOKENS:-$((CAP_TOKENS / 8))}
CORE_TESTS="tests/test_offload_engine.py tests/test_offload_mixed.py"   # issue 20's "Done when": parity on CUDA
HOST_BUDGET=${HOST_BUDGET:-auto}                    # auto: 90 % of the machine's RAM
DISK_DIR=${DISK_DIR:-/var/tmp/stratum-offload}      # the disk tier's files (check prints df of it)
PRECISION=${PRECISION:-bf16}
mkdir -p "$LOG" "$OUT" "$DISK_DIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

bundle() {  # summary and logs to $OUT, after every part: whatever a killed command leaves is current
  cp "$LOG/summary.txt" "$OUT/summary.txt"
  tar czf "$OUT/gpu-check.tar.gz.part" --exclude=checkpoints -C "$(dirname "$LOG")" "$(basename "$LOG")" \
    && mv "$OUT/gpu-check.tar.gz.part" "$OUT/gpu-check.tar.gz"
}

step() {  # name, seconds, command...: one command of a part, its log's tail and exit status in the summary
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${secs}s)" >>"$LOG/summary.txt"
  timeout --kill-after=10 "$secs" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-6}" "$LOG/$name.log" | cut -c1-300 | sed 's/^/   /' >>"$LOG/summary.txt"
  echo "   rc=$rc wall=$((SECONDS - t0))s" >>"$LOG/summary.txt"
  tail -n "${TAIL:-6}" "$LOG/$name.log" | cut -c1-300
  echo "== $name rc=$rc wall=$((SECONDS - t0))s"
  [ $rc -eq 0 ] || status=1
  bundle
}

limit() {  # the time limit of a part: T_<part>, else the default given
  local var="T_${1//-/_}"
  echo "${!var:-$2}"
}

bench() {  # mode, name, extra args...: offload_bench.py at the seeds' batch on $PRESET
  local mode=$1 name=$2; shift 2
  step "$name" "$(limit "$name" 560)" "$PY" benchmarks/offload_bench.py "$mode" --device "$DEVICE" \
    --preset "$PRESET" --micro-batch "$MICRO" --max-micro-batch "$MAX_MICRO" --tokens-per-step "$TOKENS" \
    --seq-len "$SEQ" --steps "$STEPS" --warmup "$WARMUP" --set "train.precision='$PRECISION'" \
    --out "$LOG/offload_${name}_${DEVICE}.json" "$@"
}

capacity() {  # engines, presets, micro-batch, tokens per step, name
  local secs
  secs=$(limit "$5" 560)
  # each run's own limit ends it (and the part writes its JSON) before the part's limit ends the part
  step "$5" "$secs" "$PY" benchmarks/offload_bench.py capacity --device "$DEVICE" --engines "$1" \
    --presets "$2" --micro-batch "$3" --tokens-per-step "$4" --seq-len "$CAP_SEQ" --steps "$CAP_STEPS" \
    --warmup 1 --device-budget "$DEVICE_BUDGET" --host-budget "$HOST_BUDGET" --disk-dir "$DISK_DIR" \
    --set "train.precision='$PRECISION'" --timeout "$((secs - 30))" --out "$LOG/offload_$5_${DEVICE}.json"
}

train() {  # name, overrides...: a short `stratum train` on the device, from scratch (a run again starts afresh)
  local name=$1; shift
  local args=()
  rm -rf "$LOG/train-$name"
  for kv in "train.device='$DEVICE'" "train.steps=$CLI_STEPS" "model.preset='$CLI_PRESET'" \
            "train.micro_batch_size=$CLI_MICRO" "data.seq_len=$CLI_SEQ" "train.eval_interval=0" \
            "train.out_dir='$LOG/train-$name'" "train.resume=false" "$@"; do
    args+=(--set "$kv")
  done
  step "cli-$name" "$(limit "cli-$name" 100)" "$PY" -m stratum train "${args[@]}"
}

part_facts() {
  TAIL=40 step facts "$(limit facts 60)" bash -c "$PY benchmarks/gpu_facts.py '$DISK_DIR' /tmp .; uptime
    grep -E 'MemTotal|MemAvailable' /proc/meminfo; df -h '$DISK_DIR' /tmp . 2>/dev/null
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm --format=csv; fi"
}

device_tests() {  # every test file that honours STRATUM_TEST_DEVICE (tests/offload_helpers.py's DEV, or itself)
  grep -l -E 'offload_helpers|STRATUM_TEST_DEVICE' tests/test_*.py | tr '\n' ' '
}

tests() {  # name, default limit, files...: those test files on $DEVICE
  local name=$1 secs=$2 args=$PYTEST_ARGS; shift 2
  # without pytest-xdist or pytest-timeout the tests still run: in one process, or with no per-test limit
  "$PY" -c "import xdist" 2>/dev/null || args=$(echo "$args" | sed -E 's/-n *[0-9]+//')
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then args="$args --timeout 300"; fi
  echo "   $name: files $*; pytest arguments: $args" >>"$LOG/summary.txt"
  # shellcheck disable=SC2086  # args is a list of words
  TAIL=25 step "$name" "$(limit "$name" "$secs")" env STRATUM_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q \
    -p no:cacheprovider -rfEs --durations=10 --junitxml="$LOG/$name.xml" $args "$@"
}

part_check() {
  part_facts
  # shellcheck disable=SC2046  # a list of files
  tests tests-offload 420 $(device_tests)
}

part_tests_rest() {  # the device's test files other than the core ones
  local f rest=()
  for f in $(device_tests); do
    case " $CORE_TESTS " in *" $f "*) ;; *) rest+=("$f") ;; esac
  done
  tests tests-rest 200 "${rest[@]}"
}

part_session() {  # the first call of a 15-minute device session: about 6 minutes of limits in all
  T_facts=${T_facts:-30} part_facts
  # shellcheck disable=SC2086  # a list of files
  tests tests-core 150 $CORE_TESTS
  TOKENS=$SESSION_TOKENS STEPS=$SESSION_STEPS WARMUP=1 T_overhead=${T_overhead:-100} bench overhead overhead \
    --plain-twice
  TOKENS=$SESSION_TOKENS STEPS=$SESSION_STEPS WARMUP=1 T_offload25=${T_offload25:-130} bench offload offload25
}

part_session2() {  # the second call, where the first left time for one: about 6 minutes of limits
  part_tests_rest
  CAP_STEPS=2 T_capacity_offload=${T_capacity_offload:-200} \
    capacity offload "$CAP_OFFLOAD" "$CAP_MICRO" "$SESSION_CAP_TOKENS" capacity-offload
}

part_cli() {
  train plain
  train offload25 "train.engine='offload'" "offload.device_budget='25%'"
  train bf16-chunks "train.engine='offload'" "offload.device_budget='25%'" "offload.optimizer_tier='host'" \
    "train.precision='bf16'"
  train fp16 "train.engine='offload'" "offload.device_budget='25%'" "offload.optimizer_tier='host'" \
    "train.precision='fp16'"
  step cli-plan "$(limit cli-plan 100)" "$PY" -m stratum plan --set "train.device='$DEVICE'" \
    --set "model.preset='$PLAN_PRESET'" --set "train.micro_batch_size=$PLAN_MICRO" --set "data.seq_len=$PLAN_SEQ" \
    --set "offload.device_budget='25%'" --set "train.precision='$PRECISION'"
}

part_sweep() {  # sharded-lrtf on the device: 6 jobs' shard tasks on 2 slots of it, waiting jobs' slots given back;
  # calibrated first, so its last line is the measured makespan beside the predicted one
  local dev=$DEVICE
  [ "$dev" = cuda ] && dev=cuda:0
  rm -rf "$LOG/sweep"
  cat >"$LOG/sweep.toml" <<EOF
[sweep]
out_dir = "$LOG/sweep"
scheduler = "sharded-lrtf"
devices = ["$dev", "$dev"]
device_budget = "$SWEEP_BUDGET"
device_memory = "$SWEEP_MEMORY"
calibration = "auto"
[sweep.grid]
"optim.lr" = [1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3]
[model]
preset = "$CLI_PRESET"
[data]
seq_len = $CLI_SEQ
[train]
steps = $SWEEP_STEPS
micro_batch_size = $CLI_MICRO
eval_interval = 0
EOF
  step sweep "$(limit sweep 240)" "$PY" -m stratum sweep --config "$LOG/sweep.toml"
}

part_multiplex() {  # the foreground's slowdown and the background's share on one device; under MPS where it starts
  local args=(benchmarks/multiplex_bench.py --device "$DEVICE" --rounds 1 --fg-preset "$MPLEX_FG" --bg-preset
              "$MPLEX_BG" --seq-len "$MPLEX_SEQ" --batch "$MPLEX_BATCH" --fg-steps "$MPLEX_STEPS" --bg-steps "$MPLEX_STEPS" --skip 2)
  step multiplex "$(limit multiplex 240)" "$PY" "${args[@]}" --out "$LOG/multiplex_${DEVICE}.json"
  [ "$DEVICE" = cuda ] && command -v nvidia-cuda-mps-control >/dev/null || return 0
  # the daemon's sockets live outside $LOG (the bundle's tar takes no sockets); its log goes with the results
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/stratum-mps-pipe CUDA_MPS_LOG_DIRECTORY="$LOG/mps-log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    step multiplex-mps "$(limit multiplex-mps 240)" "$PY" "${args[@]}" --out "$LOG/multiplex_mps_${DEVICE}.json"
    echo quit | nvidia-cuda-mps-control
  else
    echo "   multiplex-mps: nvidia-cuda-mps-control -d refused here" >>"$LOG/summary.txt"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

run_part() {
  case $1 in
    session) part_session ;;
    session2) part_session2 ;;
    check) part_check ;;
    facts) part_facts ;;
    tests-core) tests tests-core 150 $CORE_TESTS ;;  # (a list of files)
    tests-rest) part_tests_rest ;;
    cli) part_cli ;;
    sweep) part_sweep ;;
    multiplex) part_multiplex ;;
    overhead) bench overhead overhead --plain-twice ;;
    offload25) bench offload offload25 ;;
    capacity-offload) capacity offload "$CAP_OFFLOAD" "$CAP_MICRO" "$CAP_TOKENS" capacity-offload ;;
    capacity-plain) capacity plain "$CAP_PLAIN" 1 0 capacity-plain ;;
    all) for p in check overhead offload25 capacity-offload capacity-plain cli sweep multiplex; do run_part "$p"; done ;;
    *) echo "gpu_check.sh: unknown part '$1' (session session2 check facts tests-core tests-rest overhead" \
         "offload25 capacity-offload capacity-plain cli sweep multiplex all)" >&2
       exit 2 ;;
  esac
}

[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu_check.sh PART... (see the header)" >&2; exit 2; }
echo "== gpu_check $* on $DEVICE, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)" \
  >>"$LOG/summary.txt"
for p in "$@"; do run_part "$p"; done
exit $status
