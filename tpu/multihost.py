"""Run one ``tmax-jax`` sub-command as one process of a multi-controller JAX program.

Every host runs the same command line (``tpu/launch.sh`` does this with ``--worker=all``):

    python tpu/multihost.py train configs/qwen35-9b-v5p-64.yaml

``jax.distributed.initialize`` is called before any JAX computation. On a Cloud TPU slice (and under
SLURM or Open MPI) it discovers the coordinator, the process count and this process's index by
itself. Elsewhere (several GPU hosts, or several processes on one machine) set

    JAX_COORDINATOR_ADDRESS=host0:8476 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=<0 or 1>

on every process. After it, ``jax.devices()`` lists the devices of all hosts and ``make_mesh`` spans
them; ``jax.process_index()`` selects each host's share of the prompts (``tmax_jax.data``).
"""

from __future__ import annotations

import os
import sys


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        sys.exit(f"multihost.py: {name}={raw!r} is not an integer")


def initialize() -> None:
    import jax

    from tmax_jax.distributed import DistributedConfig
    from tmax_jax.distributed import initialize as join

    num_processes = _env_int("JAX_NUM_PROCESSES")
    process_id = _env_int("JAX_PROCESS_ID")
    if (num_processes is None) != (process_id is None):
        sys.exit("multihost.py: set both JAX_NUM_PROCESSES and JAX_PROCESS_ID, or neither (auto-detect)")
    if num_processes is None:
        cfg = DistributedConfig(mode="auto")
    else:
        address = os.environ.get("JAX_COORDINATOR_ADDRESS")
        if not address:
            sys.exit("multihost.py: JAX_NUM_PROCESSES/JAX_PROCESS_ID need JAX_COORDINATOR_ADDRESS=host:port")
        cfg = DistributedConfig(
            mode="explicit", coordinator_address=address, num_processes=num_processes, process_id=process_id
        )
    # Through tmax_jax.distributed, so a command that joins again from its config is a no-op.
    join(cfg)
    print(
        f"[process {jax.process_index()}/{jax.process_count()}] "
        f"{jax.local_device_count()} local of {jax.device_count()} devices ({jax.devices()[0].platform})",
        flush=True,
    )


def main(argv: list[str]) -> int:
    initialize()
    from tmax_jax.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
