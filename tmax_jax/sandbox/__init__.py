"""Sandboxes for episodes and verifiers: one interface, three backends (bwrap, podman, apptainer).

from tmax_jax.sandbox import SandboxConfig, make_sandbox, SandboxPool
with make_sandbox(SandboxConfig()) as sb:          # bwrap on the host's read-only rootfs
    sb.exec("echo hi").stdout                        # 'hi\\n'
    sh = sb.shell(); sh.run("cd /tmp"); sh.run("pwd").stdout   # '/tmp'
"""

from tmax_jax.sandbox.base import EpisodeTimeout, Sandbox
from tmax_jax.sandbox.config import ExecResult, SandboxConfig
from tmax_jax.sandbox.factory import make_sandbox
from tmax_jax.sandbox.pool import PoolMetrics, SandboxPool
from tmax_jax.sandbox.shell import ShellSession

__all__ = [
    "EpisodeTimeout",
    "ExecResult",
    "PoolMetrics",
    "Sandbox",
    "SandboxConfig",
    "SandboxPool",
    "ShellSession",
    "make_sandbox",
]
