"""The host allocator setting (tmax_jax/hostmem.py), checked against the kernel's page-fault counter.

Each case runs in a fresh Python: the setting only takes before JAX starts its CPU threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tmax_jax import hostmem
from tmax_jax.errors import ConfigError

pytestmark = pytest.mark.skipif(hostmem._libc() is None, reason="glibc only")

_PROBE = r"""
import json, resource, sys
from tmax_jax import hostmem
applied = hostmem.configure(sys.argv[1])
import jax, jax.numpy as jnp

@jax.jit
def f(x):
    a = x @ x.T  # [N, N] float32: a temporary far over glibc's largest mmap threshold (32 MiB)
    return (a @ x).sum()

x = jnp.ones((5000, 16), jnp.float32) / 100
temp = 5000 * 5000 * 4  # the [N, N] product's bytes
faults = []
for _ in range(5):
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
late = hostmem.configure("reuse")
asynchronous = jax.config.values["jax_cpu_enable_async_dispatch"]
print(json.dumps(dict(applied=applied, temp=temp, faults=faults, late=late, asynchronous=asynchronous)))
"""


def _probe(mode: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop(hostmem.ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_system_malloc_refaults_the_temporary_every_call():
    r = _probe("system")
    assert r["applied"] == "system" and r["asynchronous"]
    pages = r["temp"] // 4096
    # glibc maps the block afresh on every call: each call faults in (nearly) all of its pages.
    assert min(r["faults"][2:]) > pages * 3 // 4, r


def test_reuse_keeps_the_temporary_mapped():
    r = _probe("auto")  # JAX_PLATFORMS=cpu: auto means reuse
    assert r["applied"] == "reuse" and not r["asynchronous"]
    pages = r["temp"] // 4096
    assert max(r["faults"][2:]) < pages // 20, r
    assert r["late"] == "reuse"  # once applied, it stays applied


def test_too_late_once_the_backend_runs():
    code = (
        "import jax, jax.numpy as jnp; jnp.ones(3).block_until_ready();"
        "from tmax_jax import hostmem; print(hostmem.configure('reuse'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "skipped: the JAX backend has already started its threads"


def test_cpu_only_reads_jax_platforms(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert hostmem.cpu_only()
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not hostmem.cpu_only()


def test_bad_mode_is_named(monkeypatch):
    monkeypatch.setattr(hostmem, "_applied", None)
    monkeypatch.setenv(hostmem.ENV, "fast")
    with pytest.raises(ConfigError, match="TMAX_JAX_HOST_MALLOC='fast'.*auto, reuse, system"):
        hostmem.configure()


def test_cli_rejects_a_bad_mode():
    out = subprocess.run(
        [sys.executable, "-m", "tmax_jax", "plan", "configs/tiny-cpu.yaml"],
        env=dict(os.environ, **{hostmem.ENV: "fast"}),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 2
    assert "TMAX_JAX_HOST_MALLOC='fast'" in out.stderr
