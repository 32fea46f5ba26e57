"""Sandbox latency and pool throughput, with ratios against baselines measured in the same run.

    python3 benchmarks/bench_sandbox.py [--backends bwrap,podman] [--episodes 64] [--concurrency 1,2,8,32]

Prints start / exec / shell latency (median, p95) per backend, next to a plain host subprocess
(``subprocess.run(["true"])``), and episodes/s through the pool at each concurrency, relative to
concurrency 1. An episode = start a sandbox, write a file, run a small Python verifier through
``Sandbox.run_verifier`` (its own namespaces, /tests and /logs/verifier out of the agent's reach),
read the reward it wrote, close. ``verifier`` latency is one ``run_verifier`` of that verifier, next
to ``exec verifier``: the same command run as a plain ``exec`` in the agent's namespaces (what the
runner did before the verifier had namespaces of its own), so their difference is the isolation's cost.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tmax_jax.sandbox import SandboxConfig, SandboxPool, make_sandbox
from tmax_jax.tasks.reward import parse_reward

VERIFIER = (
    "python3 -c \"import pathlib; ok = pathlib.Path('/app/answer.txt').read_text().strip() == '42'; "
    "pathlib.Path('/logs/verifier').mkdir(parents=True, exist_ok=True); "
    "pathlib.Path('/logs/verifier/reward.txt').write_text('1' if ok else '0')\""
)


def pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def fmt(xs):
    return f"median {statistics.median(xs) * 1e3:7.1f} ms   p95 {pct(xs, 0.95) * 1e3:7.1f} ms"


def host_baseline(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(["true"])
        out.append(time.perf_counter() - t)
    return out


def latency(cfg: SandboxConfig, n_start: int, n_exec: int) -> dict[str, list[float]]:
    starts, closes = [], []
    for _ in range(n_start):
        t = time.perf_counter()
        sb = make_sandbox(cfg)
        starts.append(time.perf_counter() - t)
        t = time.perf_counter()
        sb.close()
        closes.append(time.perf_counter() - t)
    execs, shells = [], []
    with make_sandbox(cfg) as sb:
        sb.exec("true")
        for _ in range(n_exec):
            t = time.perf_counter()
            sb.exec("true")
            execs.append(time.perf_counter() - t)
        sh = sb.shell()
        for _ in range(n_exec):
            t = time.perf_counter()
            sh.run("true")
            shells.append(time.perf_counter() - t)
        sb.write_file("/app/answer.txt", "42\n")
        verifier, exec_verifier = [], []
        for _ in range(max(5, n_exec // 5)):
            t = time.perf_counter()
            sb.exec(VERIFIER)
            exec_verifier.append(time.perf_counter() - t)
            t = time.perf_counter()
            sb.run_verifier(TESTS, ["/bin/bash", "/tests/test.sh"], timeout=60)
            verifier.append(time.perf_counter() - t)
    return {
        "start": starts,
        "close": closes,
        "exec": execs,
        "shell": shells,
        "exec verifier": exec_verifier,
        "verifier": verifier,
    }


TESTS = Path(tempfile.mkdtemp(prefix="tmax-bench-tests-"))
(TESTS / "test.sh").write_text(VERIFIER + "\n")


def episode(sb) -> float:
    sb.write_file("/app/answer.txt", "42\n")
    run = sb.run_verifier(TESTS, ["/bin/bash", "/tests/test.sh"], timeout=60)
    return parse_reward(run.logs).value


def throughput(cfg: SandboxConfig, concurrency: int, episodes: int) -> tuple[float, dict]:
    with SandboxPool(cfg, size=concurrency, queue_size=concurrency) as pool:
        t = time.perf_counter()
        futs = [pool.run(episode) for _ in range(episodes)]
        rewards = [f.result() for f in futs]
        dt = time.perf_counter() - t
        m = pool.metrics.summary()
    assert rewards == [1.0] * episodes, rewards
    return episodes / dt, m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="bwrap,podman")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--concurrency", default="1,2,8,32")
    ap.add_argument("--n-start", type=int, default=20)
    ap.add_argument("--n-exec", type=int, default=50)
    args = ap.parse_args()
    base = host_baseline(args.n_exec)
    print(f"host subprocess.run(['true']):  {fmt(base)}")
    with tempfile.TemporaryDirectory() as cache:
        for backend in args.backends.split(","):
            if backend == "podman":
                from tmax_jax.sandbox.podman_images import podman_available

                ok, why = podman_available()
                if not ok:
                    print(f"[podman] skipped: {why}")
                    continue
                cfg = SandboxConfig(backend="podman")  # default cache: the base image is reused
                n_start, n_exec, episodes = (
                    max(3, args.n_start // 4),
                    max(10, args.n_exec // 5),
                    max(8, args.episodes // 4),
                )
            else:
                cfg = SandboxConfig(backend=backend, cache_dir=cache)
                n_start, n_exec, episodes = args.n_start, args.n_exec, args.episodes
            lat = latency(cfg, n_start, n_exec)
            med = statistics.median(base)
            print(f"\n[{backend}]")
            for k in ("start", "close", "exec", "shell", "exec verifier", "verifier"):
                print(f"  {k:<13} {fmt(lat[k])}   (x{statistics.median(lat[k]) / med:6.1f} host subprocess)")
            extra = statistics.median(lat["verifier"]) - statistics.median(lat["exec verifier"])
            print(f"  verifier isolation adds {extra * 1e3:+.1f} ms median per verification")
            rates = {}
            for c in [int(x) for x in args.concurrency.split(",")]:
                if backend == "podman" and c > 8:
                    continue
                rate, m = throughput(cfg, c, episodes)
                rates[c] = rate
                rel = f"   (x{rate / rates[min(rates)]:.2f} vs concurrency {min(rates)})"
                print(
                    f"  pool concurrency {c:>2}: {rate:6.1f} episodes/s{rel}   "
                    f"start p50 {m['start_p50_s'] * 1e3:.0f} ms p95 {m['start_p95_s'] * 1e3:.0f} ms, "
                    f"exec p50 {m['exec_p50_s'] * 1e3:.0f} ms, failures {m['failures'] or 'none'}"
                )


if __name__ == "__main__":
    main()
