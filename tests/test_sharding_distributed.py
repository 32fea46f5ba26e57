"""Two real JAX processes on this machine join through jax.distributed, assemble one global batch,
gather JSON from each other and copy params sharded over both onto each one's own devices."""

import os
import socket
import subprocess
import sys

import pytest
from xla_flags import xla_flags

from tmax_jax.distributed import DistributedConfig, initialize
from tmax_jax.errors import ConfigError

CHILD = """
import faulthandler
import sys
faulthandler.dump_traceback_later(200, exit=True)  # a hang shows every thread's stack, then exits
import numpy as np
from tmax_jax.distributed import DistributedConfig, initialize, is_primary
import jax
cfg = DistributedConfig(mode="explicit", coordinator_address=sys.argv[1], num_processes=2,
                        process_id=int(sys.argv[2]), initialization_timeout_s=60)
assert initialize(cfg) and not initialize(cfg)
from tmax_jax.sharding import MeshConfig, global_batch, make_mesh
mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))
pid = jax.process_index()
local = {"input_ids": np.full((2, 5), pid, np.int32)}  # each host feeds its own 2 rows
arr = global_batch(local, mesh)["input_ids"]
mine = sorted(int(s.data[0, 0]) for s in arr.addressable_shards)
print("RESULT", jax.process_count(), len(jax.devices()), arr.shape, mine, is_primary(), flush=True)

# Every process's JSON, in process order, on every process.
from tmax_jax.distributed import allgather_json
print("GATHER", allgather_json({"pid": pid, "pad": "x" * (3 * pid)}), flush=True)

# A full copy of params sharded over both processes, on this process's own devices.
from flax import nnx
from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.rl.train_step import make_model
from tmax_jax.sharding import ProcessReplicas, param_shardings
params = nnx.state(make_model(Qwen35Config.preset("tiny"), seed=3), nnx.Param)
expected = [np.asarray(x) for x in jax.tree.leaves(params)]
spread = jax.device_put(params, param_shardings(params, mesh))
local = jax.tree.leaves(ProcessReplicas(spread)(spread))
here = set(jax.local_devices())
ok = all(
    set(a.devices()) <= here and np.array_equal(np.asarray(a), e) for a, e in zip(local, expected)
)
spans = any(not s.is_fully_addressable for s in jax.tree.leaves(spread))
print("REPLICA", ok, spans, len(local) == len(expected), flush=True)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_build_one_global_batch():
    addr = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, addr, str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            tails = [q.communicate()[1][-3000:] for q in procs]
            raise AssertionError(f"process {i} hung; stderr tails: {tails}") from None
        assert p.returncode == 0, err[-2000:]
        outs.append({line.split()[0]: line for line in out.splitlines() if line[:1].isupper()})
    # 2 processes x 2 devices; 4 global rows, each process holding its own rows on its devices.
    assert outs[0]["RESULT"] == "RESULT 2 4 (4, 5) [0, 0] True"
    assert outs[1]["RESULT"] == "RESULT 2 4 (4, 5) [1, 1] False"
    gathered = "GATHER [{'pid': 0, 'pad': ''}, {'pid': 1, 'pad': 'xxx'}]"
    assert outs[0]["GATHER"] == outs[1]["GATHER"] == gathered
    # The params spanned both processes; each process got every value back, on its own devices.
    assert outs[0]["REPLICA"] == outs[1]["REPLICA"] == "REPLICA True True True"


def test_config_validation_and_off_mode():
    assert initialize(DistributedConfig()) is False
    with pytest.raises(ConfigError, match="coordinator_address"):
        DistributedConfig(mode="explicit", num_processes=2, process_id=0)
    with pytest.raises(ConfigError, match="process_id=2"):
        DistributedConfig(mode="explicit", coordinator_address="h:1", num_processes=2, process_id=2)
