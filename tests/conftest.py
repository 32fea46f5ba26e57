"""Test-wide setup: 8 fake CPU devices for sharding tests, fast compiles, float32 matmuls, strict rank
promotion.

Fast compiles: every JAX process of the suite compiles with LLVM at -O0 (tests/xla_flags.py).

float32 matmuls: ``jax_default_matmul_precision`` is "float32" for the whole suite (below), so no
TF32 / bf16 passes on an accelerator and references agree.

One persistent compilation cache per session: a fresh directory, made by the first process that
loads this file (pytest's controller) and inherited by the xdist workers and the subprocesses tests
start; removed when that process ends. The suite builds the same tiny engines and train steps in
many tests, and each program then compiles once (about a third less wall time on
test_engine_speculative.py). A ``JAX_COMPILATION_CACHE_DIR`` already set is used as it is.

Strict rank promotion (an implicit broadcast between arrays of different rank is an error; scalars
still broadcast) applies only to tests marked ``strict_ranks`` (module-wide with ``pytestmark``):
the RL logprob/loss/policy-head tests and the model-logits test over the tiny Qwen 3.5, Qwen3 dense
and MoE presets (test_rl_policy_head.py). Other tests run under JAX's default ("allow").
"""

import os
import shutil
import tempfile

from xla_flags import xla_flags  # tests/ is on sys.path (rootdir conftest)

# Must be set before jax is imported anywhere in the test process (LLVM -O0: see xla_flags.py).
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="tmax-jax-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402
import pytest  # noqa: E402

# float32 matmuls mean float32 (no TF32 / bf16 passes on accelerators), so references agree.
jax.config.update("jax_default_matmul_precision", "float32")


def pytest_configure(config):
    config.addinivalue_line("markers", "strict_ranks: run under jax_numpy_rank_promotion='raise'")


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:  # only the process that made it (the workers inherited the path)
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _rank_promotion(request):
    if request.node.get_closest_marker("strict_ranks") is None:
        yield
        return
    with jax.numpy_rank_promotion("raise"):
        yield


# The longest files (measured on a clean clone), run first: with `-n 2 --dist loadfile` each worker
# takes whole files in collection order, so a long file started near the end leaves the other worker
# idle while it finishes. Every other file keeps its place.
LONGEST_FIRST = (
    "test_train_multihost.py",
    "test_qwen35_parity.py",
    "test_qwen35_moe.py",
    "test_qwen35_delta_rule.py",
    "test_eval_model_agent.py",
    "test_tasks_generation.py",
    "test_train_interrupt.py",
    "test_train_step.py",
    "test_data_multihost.py",
    "test_launch.py",
    "test_kernels_gated_delta_rule.py",
    "test_engine_batching.py",
    "test_engine_blocks.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
