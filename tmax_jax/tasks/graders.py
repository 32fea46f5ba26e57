"""Graded verifier helpers shipped into generated tasks (stdlib only; the source is copied verbatim
into each task's ``test_final_state.py``, so the verifier has no dependency on tmax-jax).

Each helper returns a reward in [0, 1] with partial credit where the kind allows it; ``finish``
writes the reward to /logs/verifier/reward.txt (the runner reads it) and fails the pytest run unless
the reward reaches the pass threshold, so pass/fail and the graded reward agree.
"""

# --- tmax-jax graders (begin) ---
import math as _math
import os as _os
import random as _random
from pathlib import Path as _Path

REWARD_FILE = _Path(_os.environ.get("TMAX_REWARD_FILE", "/logs/verifier/reward.txt"))


def exact_text(actual, expected):
    """Line-by-line match after stripping trailing spaces: 1.0 when equal, else the share of
    expected lines present at the right position, minus a penalty for extra lines."""
    a = [x.rstrip() for x in str(actual).strip().splitlines()]
    e = [x.rstrip() for x in str(expected).strip().splitlines()]
    if a == e:
        return 1.0
    if not e:
        return 0.0
    hits = sum(1 for i, line in enumerate(e) if i < len(a) and a[i] == line)
    extra = max(0, len(a) - len(e))
    return max(0.0, (hits - extra) / len(e)) * 0.99  # never a full score unless exact


def metric_threshold(value, bound, worst, higher_is_better=True):
    """1.0 when ``value`` meets ``bound``; linear partial credit down to 0 at ``worst``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return 0.0
    if _math.isnan(v):
        return 0.0
    if higher_is_better:
        if v >= bound:
            return 1.0
        return max(0.0, (v - worst) / (bound - worst)) * 0.99
    if v <= bound:
        return 1.0
    return max(0.0, (worst - v) / (worst - bound)) * 0.99


def adversarial_corpus(predict, cases):
    """Share of ``(input, expected)`` cases where ``predict(input) == expected`` (errors count wrong)."""
    if not cases:
        return 0.0
    ok = 0
    for x, want in cases:
        try:
            ok += predict(x) == want
        except Exception:  # noqa: BLE001 - a crashing candidate just scores that case wrong
            pass
    return ok / len(cases)


def fuzz_equivalence(candidate, reference, gen, n=200, seed=0):
    """Share of ``n`` random inputs (``gen(rng)``) on which candidate and reference agree."""
    rng = _random.Random(seed)
    ok = 0
    for _ in range(n):
        x = gen(rng)
        want = reference(x)
        try:
            ok += candidate(x) == want
        except Exception:  # noqa: BLE001
            pass
    return ok / n


def multi_protocol(checks):
    """``{name: zero-arg callable -> bool}``: the share of protocol checks that pass."""
    if not checks:
        return 0.0
    ok = 0
    for fn in checks.values():
        try:
            ok += bool(fn())
        except Exception:  # noqa: BLE001
            pass
    return ok / len(checks)


def relative_to_baseline(score, baseline):
    """Credit only for improving on the starting state (e.g. the buggy code a task ships with):
    0 at the baseline score, 1 at a perfect score."""
    if score >= 1.0:
        return 1.0
    if baseline >= 1.0:
        return 0.0
    return max(0.0, (score - baseline) / (1.0 - baseline)) * 0.99


def _unprivileged():
    """``subprocess`` arguments that run a child as the unprivileged user 65534, when this verifier
    runs as root and that id is mapped in its user namespace (not in a single-id one); else {}."""
    if _os.getuid() != 0:
        return {}
    for kind in ("uid", "gid"):
        try:
            ranges = [line.split() for line in _Path(f"/proc/self/{kind}_map").read_text().splitlines()]
        except OSError:
            return {}
        if not any(int(first) <= 65534 < int(first) + int(count) for first, _, count in ranges):
            return {}
    return {"user": 65534, "group": 65534, "extra_groups": []}


def run_untrusted(cmd, cwd, timeout=60):
    """Run ``cmd`` (a shell command that runs the agent's code: its Makefile, its script) on a copy
    of the dir ``cwd``, as an unprivileged user when the verifier runs as root, so that it can
    neither write the reward file nor signal the verifier's processes. Returns the
    ``subprocess.CompletedProcess`` (text output)."""
    import shutil as _shutil
    import subprocess as _subprocess
    import tempfile as _tempfile

    with _tempfile.TemporaryDirectory() as tmp:
        work = _os.path.join(tmp, "work")
        _shutil.copytree(cwd, work, symlinks=True)
        kw = _unprivileged()
        if kw:
            for d, dirs, files in _os.walk(tmp):
                for n in [d, *(_os.path.join(d, f) for f in dirs + files)]:
                    _os.lchown(n, kw["user"], kw["group"])
        return _subprocess.run(
            cmd, shell=True, cwd=work, capture_output=True, text=True, timeout=timeout, **kw
        )


def finish(reward, threshold=1.0):
    reward = min(1.0, max(0.0, float(reward)))
    REWARD_FILE.parent.mkdir(parents=True, exist_ok=True)
    REWARD_FILE.write_text(f"{reward:.6f}\n")
    assert reward >= threshold, f"graded reward {reward:.3f} is below {threshold}"


# --- tmax-jax graders (end) ---


def source() -> str:
    """The helper block above, to paste into a generated verifier."""
    text = _Path(__file__).read_text()
    begin = text.index("# --- tmax-jax graders (begin) ---")
    end = text.index("# --- tmax-jax graders (end) ---")
    return text[begin:end] + "# --- tmax-jax graders (end) ---\n"
