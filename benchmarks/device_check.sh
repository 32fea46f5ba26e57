#!/usr/bin/env bash
# The accelerator check, at most 10 minutes on one H100/H200. Default (issue 46): the matmul
# precision and recomputation change, before against after on the same machine:
#   1. each TMAX_JAX_F32_DOT algorithm's error and speed on a head-shaped float32 matmul (bf16x3 is
#      the head's algorithm under the "mixed" policy), and the masked head against the whole head;
#   2. the 2B train step at 8K tokens as before: TMAX_JAX_PRECISION=float32 (every delta-rule matmul
#      and the head in float32 at "highest"), remat "full": tokens/s, MFU, peak memory;
#   3. the same step, and at 32K tokens, as after: "mixed" (bfloat16 delta-rule operands with float32
#      accumulation, a three-pass head) and remat "layers" (no period-level recompute);
#   4. a profile of one 2B step at 8K tokens, before and after (busiest kernels; traces to $OUT);
#   5. the rollout engine's 0.8B bfloat16 decode at 64 and 256 slots: ms per step, tokens/s.
# --previous: the earlier issues' check (15, 17: the attention and delta-rule kernels, speculative
# decoding). Each part runs in its own process under its own limit (a crash or hang loses only that
# part); the limits add up to under 10 minutes with their kill grace. Figures: benchmarks/RESULTS.md.
#   bash benchmarks/device_check.sh              # on the accelerator host
#   bash benchmarks/device_check.sh --smoke      # tiny sizes on a CPU, to prove the script runs
#   bash benchmarks/device_check.sh --previous   # issues 15 and 17
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/tmax-jax-device-check-cache}"
PY="${PYTHON:-python3}"
SMOKE=()
SCALE=1
PREVIOUS=0
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE=(--smoke); SCALE=3 ;;  # 2 shared CPU cores compile slowly
    --previous) PREVIOUS=1 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
START=$SECONDS
BUDGET=$((560 * SCALE))

part() {
  local limit=$(( $1 * SCALE )); shift
  local left=$(( BUDGET - (SECONDS - START) ))
  if [ "$left" -lt 20 ]; then echo "=== skipped: $* (budget spent)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $* (limit ${limit}s, $((SECONDS - START))s into the check)"
  timeout -k 5 "$limit" "$PY" benchmarks/device_check.py "${SMOKE[@]}" "$@"
  local rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "=== $*: timed out after ${limit}s"
  elif [ "$rc" -ne 0 ]; then echo "=== $*: exited with status $rc"; fi
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$PREVIOUS" -eq 1 ]; then
  part 70 --part check
  part 70 --part attention  # GPU attention kernel vs the JAX form (the 32K step's super-linear part)
  part 200 --part train --size 2b --tokens 8192,32768,65536 --f32-dot bf16x6 --remat layers  # the MFU aim: 2B at 32K
  part 60 --part train --size 2b --tokens 8192 --f32-dot highest  # the baseline on the same machine
  part 80 --part engine --size 0.8b  # issue 17: bf16 decode at 64 and 256 slots
  part 50 --part engine --size 0.8b --slots 64 --speculative 3  # issue 17: a verify step's cost
  part 50 --part profile --size 2b --tokens 8192 --f32-dot bf16x6  # where the step's time goes
  part 60 --part kernel
else
  BEFORE=(--precision float32 --f32-dot highest --remat full)
  AFTER=(--precision mixed --remat layers)
  part 60 --part check
  part 80 --part train --size 2b --tokens 8192 "${BEFORE[@]}"  # before, the baseline of this machine
  part 130 --part train --size 2b --tokens 8192,32768 "${AFTER[@]}"  # after
  part 70 --part profile --size 2b --tokens 8192 "${BEFORE[@]}"
  part 70 --part profile --size 2b --tokens 8192 "${AFTER[@]}"
  part 80 --part engine --size 0.8b  # decode at 64 and 256 slots (the cache written in place)
fi
echo "=== device check done in $((SECONDS - START))s"
