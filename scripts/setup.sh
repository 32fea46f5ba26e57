#!/usr/bin/env bash
# Installs everything tmax-jax needs on a fresh Debian machine with Python 3.11 (run as root or with sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
APT_PACKAGES="bubblewrap podman runc debootstrap tesseract-ocr espeak-ng sox ffmpeg"
missing=""
for p in $APT_PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi
PY=${PYTHON:-python3}
# torch is pinned to the CPU wheel (test extra only); never let pip pull a CUDA build.
# The [tpu] extra (libtpu) lets tmax-jax plan --compile and tests/test_tpu_compile.py compile for TPU
# topologies on this CPU host; it changes nothing for CPU runs (hostmem.cpu_only, tests/conftest.py).
$PY -m pip install -q -e '.[test,tpu]'
