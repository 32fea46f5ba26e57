"""Podman episode latency with the isolated verifier: start, one exec, ``run_verifier``, close.

    python3 benchmarks/bench_podman_verifier.py [--n 10]

Prints the median and p95 of each step over ``--n`` episodes, and the verifier's cost next to one
``exec`` in the same run (the verifier is a second container plus the toolchain checks). An episode:
start a sandbox, write the answer with one ``exec``, run a pytest verifier through ``run_verifier``
that writes /logs/verifier/reward.txt, close.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tmax_jax.sandbox import SandboxConfig, make_sandbox
from tmax_jax.sandbox.podman_images import ensure_base_image, podman_available

TEST_SH = """\
if python3 -m pytest -q -p no:cacheprovider /tests/test_answer.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
TEST_PY = "def test_answer():\n    assert open('/app/answer.txt').read().strip() == '42'\n"


def pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    args = ap.parse_args()
    ok, why = podman_available()
    if not ok:
        print(f"[podman] skipped: {why}")
        return
    cfg = SandboxConfig(backend="podman")
    ensure_base_image(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        tests = Path(tmp)
        (tests / "test.sh").write_text(TEST_SH)
        (tests / "test_answer.py").write_text(TEST_PY)
        steps: dict[str, list[float]] = {"start": [], "exec": [], "verifier": [], "close": [], "episode": []}
        make_sandbox(cfg).close()  # warm: the seccomp profile and the uid-mapped image layer
        for _ in range(args.n):
            t0 = time.perf_counter()
            sb = make_sandbox(cfg)
            t1 = time.perf_counter()
            sb.exec("echo 42 > /app/answer.txt")
            t2 = time.perf_counter()
            v = sb.run_verifier(tests, ["/bin/bash", "/tests/test.sh"], timeout=60)
            t3 = time.perf_counter()
            sb.close()
            t4 = time.perf_counter()
            assert v.logs.get("reward.txt") == b"1\n" and v.tampered is None, v
            for k, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
                steps[k].append(dt)
    for k, xs in steps.items():
        print(f"  {k:<9} median {statistics.median(xs) * 1e3:7.1f} ms   p95 {pct(xs, 0.95) * 1e3:7.1f} ms")
    ratio = statistics.median(steps["verifier"]) / statistics.median(steps["exec"])
    print(f"  verifier / exec (medians): x{ratio:.2f}")


if __name__ == "__main__":
    main()
