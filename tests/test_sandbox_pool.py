"""SandboxPool: concurrency bound, back-pressure, failure metrics, cleanup on errors."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sandbox_helpers import pid_ns, procs_left_in_ns

from tmax_jax.errors import SandboxError
from tmax_jax.sandbox import EpisodeTimeout, SandboxConfig, SandboxPool


@pytest.fixture
def cfg(tmp_path):
    return SandboxConfig(cache_dir=str(tmp_path / "cache"), exec_timeout_s=30)


def _run_dirs(cfg) -> list[Path]:
    run = Path(cfg.cache_dir) / "run"
    return list(run.iterdir()) if run.exists() else []


def test_pool_bounds_sandboxes_in_flight(cfg):
    live = []
    lock = threading.Lock()
    peak = [0]

    def episode(sb):
        with lock:
            live.append(sb.id)
            peak[0] = max(peak[0], len(live))
        r = sb.exec("sleep 0.3; echo done")
        with lock:
            live.remove(sb.id)
        return r.stdout

    with SandboxPool(cfg, size=3, queue_size=2) as pool:
        futs = [pool.run(episode) for _ in range(9)]
        assert [f.result() for f in futs] == ["done\n"] * 9
        m = pool.metrics.summary()
    assert peak[0] == 3 and m["in_flight_max"] == 3
    assert m["episodes"] == 9 and len(pool.metrics.start_latency_s) == 9
    assert m["exec_p50_s"] >= 0.3 and m["start_p95_s"] < 5
    assert _run_dirs(cfg) == []


def test_submit_blocks_when_the_queue_is_full(cfg):
    gate = threading.Event()
    with SandboxPool(cfg, size=1, queue_size=1) as pool:
        pool.submit(gate.wait)
        pool.submit(gate.wait)  # 1 running + 1 queued: the pool is full now
        done = threading.Event()

        def third():
            pool.submit(lambda: None)
            done.set()

        t = threading.Thread(target=third)
        t.start()
        assert not done.wait(0.5), "submit should block while the queue is full"
        gate.set()
        assert done.wait(5)
        t.join()


def test_failures_by_cause_and_cleanup_after_errors(cfg):
    nss = []

    def crash(sb):
        nss.append(pid_ns(sb.child_pid))
        sb.shell().run("sleep 300 &")
        raise ValueError("agent bug")

    def overrun(sb):
        nss.append(pid_ns(sb.child_pid))
        sb.exec("sleep 5", timeout=5)
        sb.exec("true")

    def die(sb):
        nss.append(pid_ns(sb.child_pid))
        sb.init.kill()
        sb.init.wait()
        time.sleep(0.2)

    short = SandboxConfig(cache_dir=cfg.cache_dir, episode_timeout_s=1.0)
    with SandboxPool(cfg, size=2) as pool:
        f1 = pool.run(crash)
        f2 = pool.run(overrun, cfg=short)
        f3 = pool.run(die)
        with pytest.raises(ValueError):
            f1.result()
        with pytest.raises(EpisodeTimeout):
            f2.result()
        f3.result()
        failures = pool.metrics.summary()["failures"]
    assert failures == {"error_ValueError": 1, "episode_timeout": 1, "sandbox_died": 1}
    assert all(procs_left_in_ns(ns) == [] for ns in nss)
    assert _run_dirs(cfg) == []


def test_start_failures_are_counted(cfg):
    with SandboxPool(cfg, size=1) as pool:
        with pytest.raises(SandboxError):
            pool.run(lambda sb: None, image="not-a-rootfs:1").result()
        assert pool.metrics.failures["start_failed"] == 1


def test_exception_in_the_with_block_kills_running_episodes(cfg):
    started = threading.Event()
    nss = []

    def long_episode(sb):
        nss.append(pid_ns(sb.child_pid))
        started.set()
        sb.exec("sleep 60", timeout=60)

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with SandboxPool(cfg, size=2) as pool:
            futs = [pool.run(long_episode) for _ in range(2)]
            assert started.wait(10)
            time.sleep(0.3)
            raise KeyboardInterrupt
    for f in futs:
        with pytest.raises(Exception):  # noqa: B017 - the episode is killed under it
            f.result(timeout=20)
    assert time.monotonic() - t0 < 20
    assert all(procs_left_in_ns(ns) == [] for ns in nss)
    assert _run_dirs(cfg) == []
