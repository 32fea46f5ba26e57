"""TMAX / Endless-Terminals task directories.

    task.json  test_initial_state.py  test_final_state.py  container.def  setup.sh  fixtures/  solutions/

task.json: ``prompt`` (or ``instruction``/``description``), optional ``name``, ``truth`` (the expected
answer, for graders), ``axes`` (or ``signature``: the sampled task axes) and ``limits`` with any of
agent_timeout_sec, verifier_timeout_sec, build_timeout_sec, cpus, memory, storage, allow_internet,
agent_services.
setup.sh runs at build time in ``/tmp/tmax-setup`` (a copy of setup.sh and fixtures/; env
``FIXTURES_DIR``), after container.def's %files/%post; whatever it writes to the writable paths
becomes the environment. The oracle is ``solutions/solve.sh``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tmax_jax.errors import TaskFormatError
from tmax_jax.tasks.model import (
    EnvironmentSpec,
    Task,
    TaskLimits,
    boolean,
    cpu_count,
    memory_mb,
    read_text,
    storage_mb,
    timeout_s,
)

LIMIT_KEYS = {
    "agent_timeout_sec": ("agent_timeout_s", timeout_s),
    "verifier_timeout_sec": ("verifier_timeout_s", timeout_s),
    "build_timeout_sec": ("build_timeout_s", timeout_s),
    "cpus": ("cpus", cpu_count),
    "memory": ("memory_mb", memory_mb),
    "storage": ("storage_mb", storage_mb),
    "allow_internet": ("allow_internet", boolean),
    "agent_services": ("agent_services", boolean),
}


def is_tmax(path: Path) -> bool:
    return (path / "task.json").is_file()


def load_tmax(path: Path) -> Task:
    path = Path(path)
    jpath = path / "task.json"
    if not jpath.is_file():
        raise TaskFormatError(f"{path}: missing task.json")
    text = read_text(jpath)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise TaskFormatError(f"{jpath}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TaskFormatError(f"{jpath}: top level must be an object, got {type(data).__name__}")
    prompt = next((data[k] for k in ("prompt", "instruction", "description") if k in data), None)
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskFormatError(f"{jpath}: needs a non-empty string 'prompt'")
    final = path / "test_final_state.py"
    if not final.is_file():
        raise TaskFormatError(f"{path}: missing test_final_state.py (the verifier)")
    initial = path / "test_initial_state.py"
    raw_limits = data.get("limits", {})
    if not isinstance(raw_limits, dict):
        raise TaskFormatError(f"{jpath}: 'limits' must be an object")
    limits = {}
    for k, v in raw_limits.items():
        if k not in LIMIT_KEYS:
            raise TaskFormatError(f"{jpath}: unknown limit {k!r} (known: {', '.join(sorted(LIMIT_KEYS))})")
        field, conv = LIMIT_KEYS[k]
        limits[field] = conv(v, f"{jpath}: limits.{k}")
    axes = data.get("axes", data.get("signature", {}))
    if not isinstance(axes, dict):
        raise TaskFormatError(f"{jpath}: 'axes' must be an object")
    cdef = path / "container.def"
    setup = path / "setup.sh"
    fixtures = path / "fixtures"
    env = EnvironmentSpec(
        kind="apptainer_def" if cdef.is_file() else "base",
        path=cdef if cdef.is_file() else None,
        setup_script=setup if setup.is_file() else None,
        fixtures_dir=fixtures if fixtures.is_dir() else None,
    )
    solution = next(
        (p for p in (path / "solutions" / "solve.sh", path / "solutions" / "solution.sh") if p.is_file()),
        None,
    )
    meta = {
        k: v
        for k, v in data.items()
        if k not in ("prompt", "instruction", "description", "limits", "axes", "signature")
    }
    return Task(
        name=str(data.get("name") or path.name),
        path=path,
        format="tmax",
        instruction=prompt.strip(),
        limits=TaskLimits(**limits),
        environment=env,
        final_test=final,
        initial_test=initial if initial.is_file() else None,
        solution=solution,
        metadata=meta,
        signature=dict(axes),
    )
