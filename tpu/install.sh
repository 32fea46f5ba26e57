#!/usr/bin/env bash
# Copy this checkout to every host of the slice and install it there with `pip install .[tpu]`.
# Every host gets the same committed tree (git archive of HEAD), so all processes run the same code.
# Untested here (no GCP access from the development machine); see tpu/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tpu/env.sh
source tpu/env.sh

if ! git diff --quiet HEAD --; then
  echo "install.sh: the working tree has uncommitted changes; only HEAD is copied" >&2
fi
tarball=$(mktemp -t tmax-jax-XXXXXX.tar.gz)
trap 'rm -f "$tarball"' EXIT
git archive --format=tar.gz -o "$tarball" HEAD

gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:tmax-jax.tar.gz" --worker=all "${GCLOUD_TPU_ARGS[@]}"

# TPU VM images ship an older system Python; the package needs 3.11, installed from the distro.
# bubblewrap runs the agents' sandboxes on the hosts' CPUs.
remote_script=$(
  cat <<REMOTE
set -euo pipefail
sudo apt-get update -qq
sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ${REMOTE_PYTHON} ${REMOTE_PYTHON}-venv bubblewrap
rm -rf ~/${REMOTE_DIR} && mkdir -p ~/${REMOTE_DIR}
tar -xzf ~/tmax-jax.tar.gz -C ~/${REMOTE_DIR}
[ -d ~/${REMOTE_VENV} ] || ${REMOTE_PYTHON} -m venv ~/${REMOTE_VENV}
~/${REMOTE_VENV}/bin/python -m pip install -q --upgrade pip
~/${REMOTE_VENV}/bin/python -m pip install -q "\$HOME/${REMOTE_DIR}[tpu]"
~/${REMOTE_VENV}/bin/python -c "import jax; print(jax.process_index(), jax.local_device_count(), jax.device_count())"
REMOTE
)
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --worker=all "${GCLOUD_TPU_ARGS[@]}" --command="$remote_script"
