# shellcheck shell=bash
# Settings shared by the tpu/*.sh scripts. Override any of them in the environment, e.g.
#   TPU_NAME=tmax-9b ZONE=us-east5-a ACCELERATOR=v5p-64 bash tpu/create_slice.sh
# Sourced, not run.

: "${PROJECT:=$(gcloud config get-value project 2>/dev/null)}"
: "${ZONE:=us-east5-a}"
: "${TPU_NAME:=tmax-jax}"
: "${QUEUED_RESOURCE:=${TPU_NAME}-qr}"
: "${ACCELERATOR:=v5p-64}"
# Where the checkout and the virtual environment live on every TPU VM.
: "${REMOTE_DIR:=tmax-jax}"
: "${REMOTE_VENV:=tmax-venv}"
: "${REMOTE_PYTHON:=python3.11}"

# The TPU software version ("runtime") follows the generation; see
# https://cloud.google.com/tpu/docs/runtimes (JAX and PyTorch column).
if [ -z "${RUNTIME_VERSION:-}" ]; then
  case "$ACCELERATOR" in
    v6e-*) RUNTIME_VERSION=v2-alpha-tpuv6e ;;
    v5p-*) RUNTIME_VERSION=v2-alpha-tpuv5 ;;
    v5litepod-*) RUNTIME_VERSION=v2-alpha-tpuv5-lite ;;
    v4-*) RUNTIME_VERSION=tpu-ubuntu2204-base ;;
    *)
      echo "env.sh: no default runtime for ACCELERATOR=$ACCELERATOR; set RUNTIME_VERSION" >&2
      return 1
      ;;
  esac
fi

# XLA flags for FSDP-style training on TPU: overlap the parameter all-gathers and gradient
# reduce-scatters with compute (async collective fusion) and fuse the data-parallel all-reduces.
: "${LIBTPU_INIT_ARGS:=--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true --xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true --xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true}"

if [ -z "$PROJECT" ]; then
  echo "env.sh: no GCP project; set PROJECT or run 'gcloud config set project ID'" >&2
  return 1
fi

# shellcheck disable=SC2034 # used by the scripts that source this file
GCLOUD_TPU_ARGS=(--zone="$ZONE" --project="$PROJECT")
export PROJECT ZONE TPU_NAME QUEUED_RESOURCE ACCELERATOR RUNTIME_VERSION REMOTE_DIR REMOTE_VENV
export REMOTE_PYTHON LIBTPU_INIT_ARGS
