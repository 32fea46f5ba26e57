"""XLA flags for every JAX process the suite starts (the test process and its subprocesses).

The suite's programs are tiny and compile time dominates them on CPU, so LLVM runs at -O0
(``--xla_backend_optimization_level=0``): about 30% less wall time per file on 2 cores. XLA's own
graph passes (fusion, layout, sharding) are unchanged, and without fast-math LLVM may not reorder
floating-point arithmetic at any level, so results are the same; user runs keep the default.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """``XLA_FLAGS`` for a process with ``devices`` fake CPU devices (None: the one real one)."""
    count = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    return " ".join([*count, FAST_COMPILE])
