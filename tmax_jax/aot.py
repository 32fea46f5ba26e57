"""Ahead-of-time compiles of a run's programs for its TPU topology, on any host (``plan --compile``).

libtpu (the ``[tpu]`` extra) compiles for a named TPU slice without one: ``jax.experimental.topologies``
gives compile-only devices of the topology, a mesh of them carries the run's shardings, and the
programs are lowered from shapes (``nnx.eval_shape``, ``jax.ShapeDtypeStruct``), so nothing is
allocated. Compiled are the train step (``TrainStep``: the function, shardings, donation and remat
the trainer runs) and the rollout engine's batched prefill and decode block (``Engine`` at the
config's slots and full cache length), each traced for the TPU (``tmax_jax.target``: Mosaic kernels
where the config asks for Pallas) and measured by XLA:TPU's own memory analysis.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from tmax_jax.errors import ConfigError, TmaxError
from tmax_jax.train.config import TrainConfig

GiB = 1024**3
PROGRAMS = ("train_step", "prefill", "decode")
# HBM per chip by TPU generation (the topology name's prefix), in GiB.
HBM_GIB = {"v4": 32.0, "v5e": 16.0, "v5litepod": 16.0, "v5p": 95.74, "v6e": 32.0}


class CompileUnavailable(TmaxError):
    """XLA:TPU cannot compile here (libtpu is not installed)."""


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    program: str
    platform: str
    topology: str
    devices: int
    argument: int | None
    output: int | None
    alias: int | None
    temp: int | None
    hbm_bytes: int | None
    compile_s: float
    hlo_path: str | None = None
    # XLA:TPU's refusal when the program cannot fit HBM (it then reports only what the temporaries
    # alone need, in ``temp``).
    error: str | None = None

    @property
    def total(self) -> int | None:
        """Bytes live on one chip at the program's peak: inputs, outputs not aliased to an input, and
        XLA's temporaries (None when the compile was refused)."""
        if self.error is not None:
            return None
        return self.argument + self.output - self.alias + self.temp

    @property
    def fits(self) -> bool | None:
        if self.error is not None:
            return False
        return None if self.hbm_bytes is None else self.total <= self.hbm_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "program": self.program,
            "platform": self.platform,
            "topology": self.topology,
            "devices": self.devices,
            "bytes": {
                "argument": self.argument,
                "output": self.output,
                "alias": self.alias,
                "temp": self.temp,
                "total": self.total,
            },
            "hbm_bytes": self.hbm_bytes,
            "fits": self.fits,
            "compile_s": round(self.compile_s, 2),
            "hlo_path": self.hlo_path,
        }


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def hbm_bytes(topology: str) -> int | None:
    """HBM per chip of ``topology``'s generation ("v5p:2x2x1" -> v5p), None for an unknown one."""
    gen = topology.split(":", 1)[0].strip().lower()
    gib = HBM_GIB.get(gen)
    return None if gib is None else int(gib * GiB)


def topology_devices(cfg: TrainConfig) -> list:
    """The compile-only devices of ``plan.topology`` (libtpu; no TPU needed)."""
    p = cfg.plan
    if not p.topology:
        raise ConfigError(
            "plan --compile needs the TPU slice to compile for: set plan.topology (e.g. v5p:2x2x1), "
            "and plan.chip_config / plan.chips_per_host when they differ from the defaults"
        )
    if not libtpu_available():
        raise CompileUnavailable(
            "XLA:TPU is not installed here (no libtpu): install the [tpu] extra "
            "(pip install -e '.[tpu]') to compile for a TPU topology on this host"
        )
    # libtpu asks the cloud metadata server for the host's TPU unless told not to (this is no TPU
    # host), and refuses to load beside another process that loaded it (a compile needs no chip).
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            platform="tpu",
            topology_name=p.topology,
            chip_config_name=p.chip_config,
            chips_per_host_bounds=tuple(p.chips_per_host),
            num_slices=p.num_slices,
        )
    except Exception as e:  # libtpu's errors are plain RuntimeErrors / XlaRuntimeErrors
        raise ConfigError(
            f"plan.topology={p.topology!r} (chip_config={p.chip_config!r}, chips_per_host="
            f"{list(p.chips_per_host)}, num_slices={p.num_slices}): libtpu refused it: {e}"
        ) from e
    devices = list(topo.devices)
    if p.num_devices and p.num_devices != len(devices):
        raise ConfigError(
            f"plan.num_devices={p.num_devices} but plan.topology={p.topology!r} has {len(devices)} "
            "devices: make them agree (or set plan.num_devices to 0)"
        )
    return devices


def topology_mesh(cfg: TrainConfig, devices: list):
    """The run's ``(data, fsdp, tensor)`` mesh over the topology's devices, laid out as ``make_mesh``
    lays out a real slice's (``jax.make_mesh``: physical neighbours along the inner axes)."""
    import jax

    from tmax_jax.sharding import MESH_AXES

    shape = cfg.mesh.resolve(len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


def _report(name: str, compiled, seconds: float, cfg: TrainConfig, devices: list, hlo_dir: Path | None):
    mem = compiled.memory_analysis()
    hlo_path = None
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        path = hlo_dir / f"{name}.hlo.txt"
        path.write_text(compiled.as_text())
        hlo_path = str(path)
    return ProgramReport(
        program=name,
        platform=devices[0].platform,
        topology=cfg.plan.topology,
        devices=len(devices),
        argument=int(mem.argument_size_in_bytes),
        output=int(mem.output_size_in_bytes),
        alias=int(mem.alias_size_in_bytes),
        temp=int(mem.temp_size_in_bytes),
        hbm_bytes=hbm_bytes(cfg.plan.topology),
        compile_s=seconds,
        hlo_path=hlo_path,
    )


def _refused(name: str, message: str, seconds: float, cfg: TrainConfig, devices: list) -> ProgramReport:
    """XLA:TPU refused to compile ``name`` for lack of HBM: what it said it needed, not a crash."""
    need = re.search(r"temporaries \(([\d.]+)([KMGT])\)", message)
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    temp = int(float(need.group(1)) * scale[need.group(2)]) if need else None
    line = next((x for x in message.splitlines() if "RESOURCE_EXHAUSTED" in x), message.splitlines()[0])
    return ProgramReport(
        program=name,
        platform=devices[0].platform,
        topology=cfg.plan.topology,
        devices=len(devices),
        argument=None,
        output=None,
        alias=None,
        temp=temp,
        hbm_bytes=hbm_bytes(cfg.plan.topology),
        compile_s=seconds,
        error=line.strip()[:400],
    )


def train_rows(cfg: TrainConfig, rows_multiple: int) -> int:
    """The rows of the largest batch the trainer feeds: every trajectory of a step in a row of its
    own, rounded up to the step's row multiple (``pack_trajectories``)."""
    return -(-cfg.rows_per_step // rows_multiple) * rows_multiple


def compile_programs(
    cfg: TrainConfig,
    programs: tuple[str, ...] = PROGRAMS,
    *,
    hlo_dir: str | Path | None = None,
    on_report=None,
) -> list[ProgramReport]:
    """Compile ``programs`` of ``cfg``'s run for ``plan.topology``; one report each, in order
    (``on_report`` is called with each as soon as it is made)."""
    import jax.numpy as jnp
    from flax import nnx

    from tmax_jax.rl.train_step import TrainStep, make_model
    from tmax_jax.target import compiling_for

    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown:
        raise ConfigError(f"unknown program(s) {unknown}; expected some of {list(PROGRAMS)}")
    devices = topology_devices(cfg)
    mesh = topology_mesh(cfg, devices)
    platform = devices[0].platform
    out_dir = None if hlo_dir is None else Path(hlo_dir)
    dtype, param_dtype = jnp.dtype(cfg.model.dtype), jnp.dtype(cfg.model.param_dtype)
    remat = cfg.rl.train_step.remat
    model = nnx.eval_shape(
        lambda: make_model(cfg.model.shape(), remat=remat, dtype=dtype, param_dtype=param_dtype)
    )
    reports = []

    def done(name, lowered_fn):
        t0 = time.perf_counter()
        try:
            compiled = lowered_fn().compile()
        except Exception as e:  # jax.errors.JaxRuntimeError
            message = str(e)
            if "RESOURCE_EXHAUSTED" not in message:
                raise
            r = _refused(name, message, time.perf_counter() - t0, cfg, devices)
        else:
            r = _report(name, compiled, time.perf_counter() - t0, cfg, devices, out_dir)
        reports.append(r)
        if on_report is not None:
            on_report(r)

    with compiling_for(platform):
        step = TrainStep(model, cfg.rl, mesh, cfg.mesh)
        if "train_step" in programs:
            rows = train_rows(cfg, step.rows_multiple)
            done(
                "train_step",
                lambda: step.lower(step.abstract_state(), step.abstract_batch(rows, cfg.seq_len)),
            )
        if "prefill" in programs or "decode" in programs:
            engine = _abstract_engine(cfg, step)
            if "prefill" in programs:
                done("prefill", engine.lower_prefill)
            if "decode" in programs:
                done("decode", engine.lower_generate_block)
    return reports


def _abstract_engine(cfg: TrainConfig, step):
    """The rollout engine ``build_run`` makes, over the train shardings' abstract params."""
    import jax.numpy as jnp
    from flax import nnx

    from tmax_jax.engine.engine import Engine

    if cfg.engine.speculative_tokens:
        raise ConfigError(
            "plan --compile: the engine's speculative decoding (engine.speculative_tokens) needs the "
            "checkpoint's MTP module; compile with --set engine.speculative_tokens=0 or --programs train_step"
        )
    params = step.abstract_state().params
    model = nnx.merge(step.graphdef, params, step.rest)
    return Engine(
        model,
        max_concurrent_decodes=cfg.engine.slots,
        max_cache_length=cfg.engine.max_cache_length,
        max_prefill_length=cfg.engine.max_prefill_length,
        cache_dtype=jnp.dtype(cfg.engine.cache_dtype),
        eos_token_ids=[0],
        record_routing=step.routing_replay,
    )


def format_report(r: ProgramReport) -> str:
    def gib(n):
        return f"{n / GiB:9.2f} GiB"

    if r.error is not None:
        need = "" if r.temp is None else f"; its temporaries alone need {gib(r.temp).strip()}"
        return (
            f"{r.program}: XLA:{r.platform.upper()} refused to compile it for {r.topology} "
            f"({r.devices} devices) after {r.compile_s:.1f} s: does NOT fit{need}\n  {r.error}"
        )

    verdict = (
        "no HBM size known for this generation"
        if r.fits is None
        else ("fits" if r.fits else f"does NOT fit (short by {(r.total - r.hbm_bytes) / GiB:.2f} GiB)")
    )
    lines = [
        f"{r.program}: XLA:{r.platform.upper()} compile for {r.topology} ({r.devices} devices) "
        f"in {r.compile_s:.1f} s, per chip:",
        f"  arguments     {gib(r.argument)}",
        f"  outputs       {gib(r.output)}  ({gib(r.alias).strip()} aliased to donated inputs)",
        f"  temporaries   {gib(r.temp)}",
        f"  total         {gib(r.total)}",
    ]
    if r.hbm_bytes is not None:
        lines.append(f"  HBM           {gib(r.hbm_bytes)}  -> {verdict}")
    if r.hlo_path:
        lines.append(f"  HLO           {r.hlo_path}")
    return "\n".join(lines)


def estimate_json(plan, cfg: TrainConfig) -> dict[str, Any]:
    """The shapes-only plan (memory_plan) as one ``--json`` object, marked as an estimate."""
    return {
        "program": "train_step",
        "estimate": True,
        "platform": None,
        "topology": cfg.plan.topology or None,
        "devices": math.prod(plan.mesh_shape.values()),
        "bytes": {"total": plan.total},
        "hbm_bytes": plan.device_memory,
        "fits": plan.fits,
        "compile_s": None,
        "hlo_path": None,
    }
