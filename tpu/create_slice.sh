#!/usr/bin/env bash
# Request a TPU pod slice through a queued resource and wait until it is ACTIVE.
#   bash tpu/create_slice.sh            # on-demand capacity
#   bash tpu/create_slice.sh --spot     # preemptible; or --reserved for a reservation
# Untested here (no GCP access from the development machine); see tpu/README.md.
set -euo pipefail
# shellcheck source=tpu/env.sh
source "$(dirname "$0")/env.sh"

extra=()
for arg in "$@"; do
  case "$arg" in
    --spot | --reserved | --guaranteed) extra+=("$arg") ;;
    *)
      echo "create_slice.sh: unknown option $arg (known: --spot, --reserved, --guaranteed)" >&2
      exit 2
      ;;
  esac
done

echo "requesting $ACCELERATOR ($RUNTIME_VERSION) as $TPU_NAME in $ZONE, project $PROJECT"
gcloud compute tpus queued-resources create "$QUEUED_RESOURCE" \
  --node-id="$TPU_NAME" \
  --accelerator-type="$ACCELERATOR" \
  --runtime-version="$RUNTIME_VERSION" \
  "${GCLOUD_TPU_ARGS[@]}" \
  "${extra[@]}"

# A queued resource waits (WAITING_FOR_RESOURCES) until capacity frees up; poll its state.
while true; do
  state=$(gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE" "${GCLOUD_TPU_ARGS[@]}" \
    --format='value(state.state)')
  echo "$(date -u +%H:%M:%S) $QUEUED_RESOURCE: $state"
  case "$state" in
    ACTIVE) break ;;
    FAILED | SUSPENDED)
      echo "create_slice.sh: queued resource ended in state $state" >&2
      exit 1
      ;;
  esac
  sleep 60
done

gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GCLOUD_TPU_ARGS[@]}" \
  --format='table(name.basename(), acceleratorType, state, networkEndpoints.len():label=HOSTS)'
