#!/usr/bin/env bash
# The accelerator check for issues 15 and 17, at most 9 minutes on one H200:
#   1. the masked LM head against the whole head, and the Pallas delta-rule kernels against the
#      pure-JAX path, on the device (values, VJP);
#   2. the delta rule's ms, tokens/s, TFLOP/s and compiled temporaries, JAX path vs kernels (T=32K);
#   3. 2B train steps at 32K, 8K and 64K tokens: tokens/s, MFU, peak device memory;
#   4. the rollout engine's 0.8B bfloat16 decode at 64 and 256 slots: ms per step, tokens/s;
#   5. a profile of one 2B step at 8K tokens: its busiest GPU kernels (trace copied to $OUT).
# Each part runs in its own process under its own limit (a crash or hang loses only that part); the
# limits add up to under 9 minutes with their kill grace.
#   bash benchmarks/device_check.sh            # on the accelerator host
#   bash benchmarks/device_check.sh --smoke    # tiny sizes on a CPU, to prove the script runs
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/tmax-jax-device-check-cache}"
PY="${PYTHON:-python3}"
SMOKE=()
SCALE=1
if [ "${1:-}" = "--smoke" ]; then SMOKE=(--smoke); SCALE=3; fi  # 2 shared CPU cores compile slowly
START=$SECONDS
BUDGET=$((510 * SCALE))

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
part 100 --part check
part 120 --part kernel
part 130 --part train --size 2b  # first: the issue's MFU aim is the 2B step at 32K tokens
part 70 --part engine --size 0.8b  # issue 17: bf16 decode at 64 and 256 slots
part 80 --part profile --size 2b --tokens 8192  # where the 2B step's time goes (6% MFU on 2026-12-04)
echo "=== device check done in $((SECONDS - START))s"
