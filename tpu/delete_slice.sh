#!/usr/bin/env bash
# Release the slice: delete the queued resource and the TPU VMs it created.
# Untested here (no GCP access from the development machine); see tpu/README.md.
set -euo pipefail
# shellcheck source=tpu/env.sh
source "$(dirname "$0")/env.sh"
gcloud compute tpus queued-resources delete "$QUEUED_RESOURCE" "${GCLOUD_TPU_ARGS[@]}" --force --quiet
