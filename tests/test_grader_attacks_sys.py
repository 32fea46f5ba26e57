"""Attack tests of the networking, devops and scientific families' graders: a solution that games the
grader instead of solving must earn (about) nothing, end to end in a bubblewrap sandbox, while an
honest near miss still earns partial credit. Each attack's reward against the grader before its fix
is in its docstring.

The numeric families grade on a log scale of the error: 95% of the credit runs out at ``near`` (a
right method short on accuracy), the last 5% at an error of 10 (the ballpark). A wrong formula or a
guess is past ``near`` by construction, so it earns at most that 5% share: the bound asserted here."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import pytest
from family_helpers import dir_of, draft_dir

from tmax_jax.sandbox import SandboxConfig
from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task

BALLPARK = 0.05  # the share of the numeric graders' credit that a wrong answer can still reach


def _run(d: Path, solve: str, cfg: SandboxConfig):
    (d / "solutions" / "solve.sh").write_text("#!/bin/bash\n" + solve)
    return run_task(load_task(d), "oracle", cfg)


@pytest.fixture
def cfg(tmp_path):
    return SandboxConfig(cache_dir=str(tmp_path / "cache"))


def test_compressing_a_replaced_log_earns_nothing(tmp_path, cfg):
    """Overwriting access.log with 20 MB of zeros and archiving that scored 1.0: the round trip and
    the ratio were both checked against the agent-writable access.log."""
    d = draft_dir(tmp_path, "compression_ratio", "swap")
    w = dir_of(d, "access.log.xz")
    res = _run(
        d, f"cd {w} && head -c 20000000 /dev/zero > access.log && xz -k -c access.log > access.log.xz\n", cfg
    )
    assert res.reward == 0.0, (res.reason, res.verifier_log[-800:])


def test_compressing_something_else_keeping_the_log_earns_nothing(tmp_path, cfg):
    """The original kept, the archive of other (highly compressible) content: no round trip."""
    d = draft_dir(tmp_path, "compression_ratio", "other")
    w = dir_of(d, "access.log.xz")
    res = _run(d, f"cd {w} && head -c 20000000 /dev/zero | xz -c > access.log.xz\n", cfg)
    assert res.reward == 0.0, (res.reason, res.verifier_log[-800:])


# The function names main.c declares, in order (both the old `void f(void);` and the new layout).
_NAMES = "names=$(sed -nE 's/^(void|unsigned) ([a-z]+)\\(.*/\\2/p' main.c)\n"


def test_a_makefile_whose_app_is_a_script_earns_nothing(tmp_path, cfg):
    """A Makefile whose 'app' is a shell script echoing the function names grepped from main.c
    scored 1.0: only app's stdout was checked, and it was the list of names."""
    d = draft_dir(tmp_path, "makefile_fix", "script")
    w = dir_of(d, "app")
    solve = (
        f"cd {w}\n{_NAMES}"
        "{ printf 'app:\\n\\tprintf \"#!/bin/sh\\\\n\" > app\\n'; "
        'for n in $names; do printf \'\\techo "echo %s" >> app\\n\' "$n"; done; '
        "printf '\\tchmod +x app\\n\\nclean:\\n\\trm -f app\\n'; } > Makefile\n"
    )
    res = _run(d, solve, cfg)
    assert res.reward == 0.0, (res.reason, res.verifier_log[-800:])


def test_a_makefile_whose_app_prints_the_names_earns_nothing(tmp_path, cfg):
    """The same trick compiled (a real ELF 'app' that prints the names): the output is now computed
    at run time through every module, so no string from the sources matches it (1.0 before)."""
    d = draft_dir(tmp_path, "makefile_fix", "elf")
    w = dir_of(d, "app")
    solve = (
        f"cd {w}\n{_NAMES}"
        "{ printf 'int puts(const char *);\\nint main(void) {\\n'; "
        "for n in $names; do printf '  puts(\"%s\");\\n' \"$n\"; done; printf '  return 0;\\n}\\n'; } > fake.txt\n"
        "printf 'app:\\n\\tcp fake.txt fake_main.c && cc -o app fake_main.c\\n\\nclean:\\n\\trm -f app\\n' > Makefile\n"
    )
    res = _run(d, solve, cfg)
    assert res.reward == 0.0, (res.reason, res.verifier_log[-800:])


def _ode(d: Path) -> tuple[float, float, float, int]:
    m = re.search(
        r"dy/dt = -([\d.]+)\*y \+ ([\d.]+) with y\(0\) = ([\d.]+) up to t = (\d+)", load_task(d).instruction
    )
    return float(m[1]), float(m[2]), float(m[3]), int(m[4])


# "zero142": a seed whose draw before the fix had y(T) = 0.043, so that writing 0 scored 0.95 there.
@pytest.mark.parametrize("attack, seed", [("equilibrium", "equilibrium"), ("zero", "zero142")])
def test_ode_answers_without_integrating_earn_at_most_the_ballpark(tmp_path, cfg, attack, seed):
    """Writing the equilibrium s/k scored 0.99 (y(T) had decayed to within 4e-5 of it) and writing 0
    scored 0.935 (linear credit down to an absolute error of 1). Now the transient is at least 0.05
    at T, and credit runs on a log scale that leaves a wrong answer at most the ballpark share."""
    d = draft_dir(tmp_path, "ode_decay", seed)
    k, s, y0, T = _ode(d)
    value = s / k if attack == "equilibrium" else 0.0
    res = _run(d, f"echo {value!r} > {dir_of(d, 'y_at_T.txt')}/y_at_T.txt\n", cfg)
    assert res.reward <= BALLPARK, (res.reward, res.reason, res.verifier_log[-800:])


def test_ode_euler_near_miss_keeps_partial_credit(tmp_path, cfg):
    """An honest method short on accuracy (explicit Euler, 2000 steps) still earns real credit."""
    d = draft_dir(tmp_path, "ode_decay", "euler")
    k, s, y0, T = _ode(d)
    y = y0
    for _ in range(2000):
        y += T / 2000 * (-k * y + s)
    exact = s / k + (y0 - s / k) * math.exp(-k * T)
    assert 1e-5 < abs(y - exact) < 1e-2
    res = _run(d, f"echo {y!r} > {dir_of(d, 'y_at_T.txt')}/y_at_T.txt\n", cfg)
    assert 0.2 < res.reward < 1.0, (res.reward, res.reason, res.verifier_log[-800:])


def _quad(d: Path) -> tuple[int, int, int, int]:
    m = re.search(
        r"f\(x\) = (\d+)\*sin\((\d+)\*x\) \+ (\d+)\*x\*\*2 over \[0, (\d+)\]", load_task(d).instruction
    )
    return int(m[1]), int(m[2]), int(m[3]), int(m[4])


@pytest.mark.parametrize("attack", ["drop_sin", "guess"])
def test_quadrature_wrong_formula_or_guess_earns_at_most_the_ballpark(tmp_path, cfg, attack):
    """Dropping the sin term scored 0.987 and a one-digit guess (100 for 167.3) 0.59: relative
    error was credited linearly down to 1. The sin term is now at least 2% of the integral."""
    d = draft_dir(tmp_path, "quadrature", attack)
    a, b, c, L = _quad(d)
    exact = a * (1 - math.cos(b * L)) / b + c * L**3 / 3
    value = c * L**3 / 3 if attack == "drop_sin" else float(f"{exact:.1g}")
    assert abs(value - exact) / exact > 1e-3  # not by chance a near miss
    res = _run(d, f"echo {value!r} > {dir_of(d, 'integral.txt')}/integral.txt\n", cfg)
    assert res.reward <= BALLPARK, (res.reward, res.reason, res.verifier_log[-800:])


def test_quadrature_coarse_simpson_keeps_partial_credit(tmp_path, cfg):
    """Simpson's rule with too few panels (relative error between the bound and 1e-3) earns credit."""
    d = draft_dir(tmp_path, "quadrature", "coarse")
    a, b, c, L = _quad(d)
    exact = a * (1 - math.cos(b * L)) / b + c * L**3 / 3
    f = lambda x: a * math.sin(b * x) + c * x * x  # noqa: E731
    n = 8
    while True:
        h = L / n
        v = (f(0) + f(L) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))) * h / 3
        if abs(v - exact) / exact < 1e-4:
            break
        n += 2
    assert abs(v - exact) / exact > 1e-6
    res = _run(d, f"echo {v!r} > {dir_of(d, 'integral.txt')}/integral.txt\n", cfg)
    assert 0.2 < res.reward < 1.0, (res.reward, res.reason, res.verifier_log[-800:])


_STATS = (
    "python3 - <<'EOF'\nimport statistics as s\nd = {d!r}\n"
    "x = [float(v) for v in open(d + '/signal.txt').read().split()]{sl}\n"
    "open(d + '/stats.txt', 'w').write({fmt})\nEOF\n"
)


@pytest.mark.parametrize(
    "attack, sl",
    [("head20_pstdev", "[:20]"), ("pstdev", "")],
)
def test_signal_stats_shortcuts_earn_at_most_the_ballpark(tmp_path, cfg, attack, sl):
    """The mean and population std of the first 20 samples scored 0.824 (error relative to the std,
    credited linearly down to 1); the population std of all samples (n, not the n-1 asked) ~0.999."""
    d = draft_dir(tmp_path, "signal_stats", attack)
    w = dir_of(d, "stats.txt")
    res = _run(d, _STATS.format(d=w, sl=sl, fmt="f'{s.fmean(x)} {s.pstdev(x)}'"), cfg)
    assert res.reward <= BALLPARK, (res.reward, res.reason, res.verifier_log[-800:])


def test_signal_stats_few_digits_keep_partial_credit(tmp_path, cfg):
    """The right statistics written with 5 decimals (an error of ~1e-5 of the std): a near miss."""
    d = draft_dir(tmp_path, "signal_stats", "digits")
    w = dir_of(d, "stats.txt")
    xs = [float(v) for v in (d / "fixtures" / "signal.txt").read_text().split()]
    m, sd = statistics.fmean(xs), statistics.stdev(xs)
    assert 1e-6 < max(abs(round(m, 5) - m), abs(round(sd, 5) - sd)) / sd < 1e-4
    res = _run(d, _STATS.format(d=w, sl="", fmt="f'{s.fmean(x):.5f} {s.stdev(x):.5f}'"), cfg)
    assert 0.2 < res.reward < 1.0, (res.reward, res.reason, res.verifier_log[-800:])


def _ini(d: Path) -> tuple[str, str, str]:
    m = re.search(
        r"In (\S+) change the \[server\] port to (\d+) and add 'timeout = (\d+)'", load_task(d).instruction
    )
    return m[1], m[2], m[3]


@pytest.mark.parametrize("edit", ["timeout", "port"])
def test_ini_edit_of_one_setting_only_earns_nothing(tmp_path, cfg, edit):
    """Only one of the two requested edits scored 0.792 (timeout) / 0.594 (port): three of the five
    checks were preservation checks that the untouched file meets."""
    d = draft_dir(tmp_path, "ini_edit", edit)
    cfg_path, port, timeout = _ini(d)
    if edit == "timeout":
        solve = f"sed -i 's/^port = .*/&\\ntimeout = {timeout}/' {cfg_path}\n"
    else:
        solve = f"sed -i 's/^port = .*/port = {port}/' {cfg_path}\n"
    res = _run(d, solve, cfg)
    assert res.reward == 0.0, (res.reward, res.reason, res.verifier_log[-800:])


def test_ini_edit_losing_a_section_keeps_partial_credit(tmp_path, cfg):
    """Both edits made but the [db] section lost: credit for what was preserved, not full."""
    d = draft_dir(tmp_path, "ini_edit", "lossy")
    cfg_path, port, timeout = _ini(d)
    solve = (
        f"python3 - <<'EOF'\nimport configparser\nc = configparser.ConfigParser()\nc.read('{cfg_path}')\n"
        f"c['server']['port'] = '{port}'\nc['server']['timeout'] = '{timeout}'\nc.remove_section('db')\n"
        f"with open('{cfg_path}', 'w') as f:\n    c.write(f)\nEOF\n"
    )
    res = _run(d, solve, cfg)
    assert 0.2 < res.reward < 1.0, (res.reward, res.reason, res.verifier_log[-800:])
