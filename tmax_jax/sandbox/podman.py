"""Podman backend: one long-lived container per sandbox (``sleep infinity``), ``podman exec`` per command.

Flags that matter on these machines: ``--runtime runc`` (crun fails on hybrid cgroups), explicit
``--ulimit nofile/nproc`` (runc cannot raise the defaults here), ``--network none``, and
``--pids-limit``/``--memory``/``--cpus`` from the config. Container-side processes are not our
children, so each command carries a ``TMAX_EXEC_ID`` in its environment and a kill finds them by it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid

from tmax_jax.errors import SandboxError
from tmax_jax.sandbox.base import Sandbox
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.podman_images import PodmanImage, ensure_base_image
from tmax_jax.sandbox.procs import kill_tree


def _pids_with_env(marker: str) -> list[int]:
    needle = marker.encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(name))
        except OSError:
            continue
    return out


class PodmanSandbox(Sandbox):
    backend = "podman"

    def __init__(self, cfg: SandboxConfig, image: PodmanImage | str | None = None):
        if isinstance(image, str):
            image = PodmanImage(image)
        super().__init__(cfg, env=None, workdir=(image.workdir if image else None))
        self.image = image
        self.name = f"tmax-{self.id}"

    def _owner_extra(self) -> dict:
        return {"container": self.name}

    def _start(self) -> None:
        cfg = self.cfg
        tag = self.image.tag if self.image else ensure_base_image(cfg)
        args = [
            "podman", "run", "-d", "--name", self.name,
            "--label", f"tmax-jax.owner={os.getpid()}",
            "--runtime", cfg.podman_runtime,
            "--network", "slirp4netns" if cfg.network else "none",
            f"--ulimit=nofile={cfg.nofile}:{cfg.nofile}", "--ulimit=nproc=4096:4096",
            f"--pids-limit={cfg.pids_max}", f"--memory={cfg.memory_mb}m", f"--memory-swap={cfg.memory_mb}m",
            f"--cpus={cfg.cpus}", "--tmpfs", f"/tmp:rw,size={cfg.disk_mb}m,mode=1777",
            "--hostname", "tmax-sandbox", "--security-opt", "no-new-privileges",
            "--init",  # catatonit as pid 1 reaps what a kill orphans
        ]  # fmt: skip
        if cfg.podman_read_only:
            args.append("--read-only")
        args += [tag, "sleep", "infinity"]
        r = subprocess.run(args, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise SandboxError(f"podman run failed: {r.stderr.strip()[-800:]}")
        mk = " ".join(sorted({self.workdir, "/logs", "/tests"}))
        r = subprocess.run(
            ["podman", "exec", self.name, "mkdir", "-p", *mk.split()],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode != 0:
            raise SandboxError(f"podman sandbox setup failed: {r.stderr.strip()[-500:]}")

    def environment(self, env=None) -> dict[str, str]:
        # The image's own ENV (PATH, ...) stays; only add what the caller and config ask for.
        out = {"TERM": "dumb", "LANG": "C.UTF-8", "HOME": "/root"}
        out.update(dict(self.cfg.env))
        out.update(env or {})
        return out

    def _exec_argv(self, argv: list[str], env: dict[str, str], cwd: str, interactive: bool) -> list[str]:
        host = ["podman", "exec"]
        if interactive:
            host.append("-i")
        host += ["-w", cwd, "-e", f"TMAX_EXEC_ID={uuid.uuid4().hex}"]
        for k, v in env.items():
            host += ["-e", f"{k}={v}"]
        return host + [self.name, *argv]

    def _on_kill(self, proc) -> None:
        marker = next(
            (a.split("=", 1)[1] for a in proc.args if isinstance(a, str) and a.startswith("TMAX_EXEC_ID=")),
            None,
        )
        if marker:
            for p in _pids_with_env(f"TMAX_EXEC_ID={marker}"):
                kill_tree(p, sig=signal.SIGKILL)

    def _on_kill_shell(self, session) -> None:
        # Only the shell and its descendants: a service the agent double-forked must survive the
        # shell, as it does on bwrap (the env-marker kill would find it too).
        if session.shell_pid_inside is None or self._closed:
            return
        try:
            self.kill_command_processes(session, 0)
            self._run(
                ["/bin/kill", "-9", str(session.shell_pid_inside)],
                timeout=15,
                stdin=None,
                env=None,
                cwd="/",
                cap=1 << 16,
            )
        except Exception:  # noqa: BLE001 - the container may be gone already
            self._on_kill(session.proc)

    def _alive(self) -> bool:
        r = subprocess.run(
            ["podman", "inspect", "-f", "{{.State.Running}}", self.name],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return r.returncode == 0 and r.stdout.strip() == "true"

    def _close(self) -> None:
        subprocess.run(["podman", "rm", "-f", "-t", "0", self.name], capture_output=True, timeout=120)
