"""Reward loopholes of the code families (families_code.py) that a red-team found, each run end to
end: the family's task is built, its reference solution is swapped for the attack, and the real
verifier grades it in a bubblewrap sandbox. Every attack here solves nothing, so it must earn what
the starting state (or the best constant answer) earns: nothing."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from family_helpers import draft_dir, family_signature

from tmax_jax.sandbox import SandboxConfig
from tmax_jax.tasks import graders, load_task
from tmax_jax.tasks.runner import run_task


def _attack(tmp_path: Path, family: str, seed: str, script: str) -> float:
    """The reward the real verifier gives ``script`` (run as the task's solution) in a sandbox."""
    d = draft_dir(tmp_path, family, seed)
    (d / "solutions" / "solve.sh").write_text("#!/bin/bash\n" + script)
    res = run_task(load_task(d), "oracle", SandboxConfig(cache_dir=str(tmp_path / "cache")))
    print(f"{family} {seed}: reward {res.reward:.4f} ({res.reason})\n{res.verifier_log[-600:]}")
    return res.reward


# 1. secret_scanner: samples.txt held the grader's first six cases with their answers, and 7 of the
# 12 cases are False, with no baseline: a table memorising the samples (default False) scored 0.917,
# ``return False`` 0.583.
SECRET_LOOKUP = r"""d=$(dirname /home/user/*/samples.txt)
python3 - "$d" <<'PY'
import sys
d = sys.argv[1]
table = {}
for l in open(d + "/samples.txt").read().splitlines():
    x, y = l.rsplit("\t", 1)
    table[x] = (y == "True")
open(d + "/scanner.py", "w").write(f"T = {table!r}\ndef is_secret(line):\n    return T.get(line, False)\n")
PY
"""
SECRET_FALSE = "d=$(dirname /home/user/*/samples.txt)\nprintf 'def is_secret(line):\\n    return False\\n' > \"$d/scanner.py\"\n"


@pytest.mark.parametrize("script", [SECRET_LOOKUP, SECRET_FALSE], ids=["lookup", "const_false"])
def test_secret_scanner_memorising_the_samples_or_a_constant_earns_nothing(tmp_path, script):
    """The samples are drawn apart from the graded cases (the table misses every one and falls back
    to False), and credit starts above the best constant answer: both are constant predictors on
    the graded cases and earn 0 (bound 0.05, the brief's for a constant predictor)."""
    assert _attack(tmp_path, "secret_scanner", "attack", script) <= 0.05


# 2. leap_year_fix: the buggy code answers True for every year, so ``return False`` (right on the
# ~2/3 of years that are not leap) scored up to 0.743 relative to it.
LEAP_FALSE = (
    "f=$(ls /home/user/*/calendar_*.py)\nprintf 'def is_leap(year):\\n    return False\\n' > \"$f\"\n"
)


def test_leap_year_constant_false_earns_nothing(tmp_path):
    """Credit starts above the better of the buggy code and the best constant answer: always False
    is a constant predictor and earns 0 (bound 0.05). Seed 'attack' scored 0.566 before."""
    assert _attack(tmp_path, "leap_year_fix", "attack", LEAP_FALSE) <= 0.05


# 3. duration_parser_fix: the buggy parser wrapped in try/except returning None fixes nothing but
# scored 0.396 (the four invalid inputs want None); False == 0 also counted as right for "0m".
DURATION_WRAP = """f=$(ls /home/user/*/durations.py)
cat > "$f" <<'PY'
def parse_duration(s):
    try:
        h, m = s.split('h')
        return int(h) * 3600 + int(m.rstrip('m')) * 60
    except Exception:
        return {fallback}
PY
"""


@pytest.mark.parametrize("fallback", ["None", "False"])
def test_duration_parser_wrapping_the_buggy_code_earns_nothing(tmp_path, fallback):
    """The buggy code with its exceptions swallowed is one of the baselines (it is no fix at all),
    and an answer must have the right type: with None it is exactly that baseline, with False it is
    right on fewer cases than the buggy code (False no longer passes for 0): both earn 0 exactly."""
    script = DURATION_WRAP.format(fallback=fallback)
    assert _attack(tmp_path, "duration_parser_fix", "attack", script) == 0.0


# 4. rle_codec: the fuzzer drew an empty string one time in nine, so ``return ""`` scored 0.083.
def test_rle_codec_constant_empty_output_earns_nothing(tmp_path):
    """Every fuzzed input now has at least one run, whose encoding is never '': 0 exactly."""
    d = draft_dir(tmp_path / "params", "rle_codec", "attack")
    p = json.loads((d / "task.json").read_text())["family_params"]
    script = f"mkdir -p $(dirname {p['module']})\nprintf 'def {p['function']}(s):\\n    return \"\"\\n' > {p['module']}\n"
    assert _attack(tmp_path, "rle_codec", "attack", script) == 0.0


# 5. vendored_slugify: the verifier (root) put the agent-writable vendor/ dir first on its own
# sys.path, so a module it imported afterwards would have come from the agent's files.
def test_vendored_slugify_keeps_the_agents_dir_off_the_verifiers_path():
    fam, sig = family_signature("vendored_slugify")
    for seed in ("a", "b", "c"):
        check = fam.make(random.Random(seed), sig).final_check
        assert "sys.path.insert" not in check and "sys.path.append" not in check
        # The vendor dir reaches the graded module's own process, as ``_load``'s extra paths only.
        vendor = next(line for line in check.splitlines() if "/vendor/" in line and "_load(" in line)
        assert vendor.rstrip().endswith("/vendor'])"), vendor


# Cheap in-process checks over many seeds (no sandbox): the real verifier code, with its module
# paths moved to a temporary dir, grades candidate modules through the real ``_load`` child process
# (which runs as 65534 when these tests run as root: the dir is readable by all, unlike tmp_path).
@pytest.fixture
def shared_dir():
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        yield Path(d)


def _grade(local: Path, draft, module_path: str, source: str | None) -> float:
    w = str(Path(module_path).parent)
    check = draft.final_check.replace(w, str(local))
    target = local / Path(module_path).name
    if source is None:
        target.unlink(missing_ok=True)
    else:
        target.write_text(source)
    ns: dict = {}
    exec(compile(graders.source() + check, "verifier", "exec"), ns)
    return ns["grade"]()


def _module_and_body(draft) -> tuple[str, str]:
    head, rest = draft.solution.split(" <<'EOF'\n", 1)
    return head.split("cat > ", 1)[1].strip(), rest.rsplit("EOF", 1)[0]


HONEST_PARTIAL = {
    # the right token shape without the boundary checks: wrong on glued tokens only
    "secret_scanner": lambda body: body.replace("(?<![A-Za-z0-9])", "").replace("(?![A-Za-z0-9])", ""),
    # no century rule
    "leap_year_fix": lambda body: "def is_leap(year):\n    return year % 4 == 0\n",
    # hours and minutes parsed, seconds not
    "duration_parser_fix": lambda body: body.replace("(?:(\\d+)s)?", "").replace(
        "h, mi, se = (int(g) if g else 0 for g in m.groups())",
        "(h, mi), se = (int(g or 0) for g in m.groups()), 0",
    ),
}

CONSTANTS = {
    "secret_scanner": ["def is_secret(line):\n    return False\n", "def is_secret(line):\n    return True\n"],
    "leap_year_fix": ["def is_leap(year):\n    return False\n", "def is_leap(year):\n    return True\n"],
    "duration_parser_fix": [
        "def parse_duration(s):\n    return None\n",
        "def parse_duration(s):\n    return 0\n",
    ],
}


@pytest.mark.parametrize("family", sorted(HONEST_PARTIAL))
def test_reference_full_constants_nothing_honest_partial_work_partial_credit(shared_dir, family):
    fam, sig = family_signature(family)
    for seed in range(8):
        draft = fam.make(random.Random(f"seed{seed}"), sig)
        mod, body = _module_and_body(draft)
        assert _grade(shared_dir, draft, mod, body) == 1.0
        assert _grade(shared_dir, draft, mod, None) == 0.0
        buggy = draft.fixtures.get(Path(mod).name)
        if buggy is not None:  # the shipped buggy code earns nothing
            assert _grade(shared_dir, draft, mod, buggy) == 0.0
        for const in CONSTANTS[family]:
            assert _grade(shared_dir, draft, mod, const) == 0.0, const
        partial = _grade(shared_dir, draft, mod, HONEST_PARTIAL[family](body))
        assert 0.2 < partial < 0.9, partial


def test_a_child_gets_the_extra_paths_and_the_parent_does_not(shared_dir):
    """``_load``'s extra paths reach the module's process (a package with a relative import loads)
    and leave the loading process's sys.path as it was."""
    from tmax_jax.tasks.generator.families_code import LOAD

    pkg = shared_dir / "vendor" / "zkit"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .text import slugify\n")
    (pkg / "text.py").write_text("def slugify(s):\n    return s.upper()\n")
    code = LOAD.replace("\n" + " " * 12, "\n") + (
        f"m = _load({str(pkg / '__init__.py')!r}, 'zkit', [{str(shared_dir / 'vendor')!r}])\n"
        "import sys\nprint(m.slugify('ab'), any(p.endswith('vendor') for p in sys.path))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["AB", "False"], out
