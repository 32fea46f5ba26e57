#!/usr/bin/env bash
# Run the same tmax-jax command on every host of the slice, as one multi-controller JAX program.
#   bash tpu/launch.sh train configs/qwen35-9b-v5p-64.yaml --run-dir /mnt/shared/run1
# Each host runs tpu/multihost.py, which calls jax.distributed.initialize() (on a TPU slice the
# coordinator, process count and process index are discovered from the TPU metadata) and then
# the command. Output goes to ~/tmax-logs/<host>.log on each host and is streamed here.
# Untested here (no GCP access from the development machine); see tpu/README.md.
set -euo pipefail
# shellcheck source=tpu/env.sh
source "$(dirname "$0")/env.sh"

if [ "$#" -eq 0 ]; then
  echo "usage: bash tpu/launch.sh <tmax-jax sub-command and arguments>" >&2
  exit 2
fi
printf -v quoted_args '%q ' "$@"

remote_script=$(
  cat <<REMOTE
set -euo pipefail
cd ~/${REMOTE_DIR}
mkdir -p ~/tmax-logs
export LIBTPU_INIT_ARGS='${LIBTPU_INIT_ARGS}'
export JAX_COMPILATION_CACHE_DIR=~/.cache/jax-compilation
~/${REMOTE_VENV}/bin/python tpu/multihost.py ${quoted_args} 2>&1 | tee ~/tmax-logs/\$(hostname).log
REMOTE
)
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --worker=all "${GCLOUD_TPU_ARGS[@]}" --command="$remote_script"
