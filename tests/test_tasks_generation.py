"""Task generation: seeded nine-axis sampling that matches its marginals, graded verifiers with
partial credit, and procedural tasks that pass the executability filter in real sandboxes."""

from __future__ import annotations

import ast
import collections
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from family_helpers import draft_dir as _draft_dir

from tmax_jax.errors import ConfigError
from tmax_jax.sandbox import SandboxConfig
from tmax_jax.tasks import graders, load_task
from tmax_jax.tasks.axes import AxisSampler
from tmax_jax.tasks.filter import check_task, filter_tasks
from tmax_jax.tasks.generator import ProceduralGenerator, all_families
from tmax_jax.tasks.runner import run_task

# chi-square critical values at p = 0.001 by degrees of freedom (a true sampler fails 1 in 1000 runs)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def test_sampling_is_seeded():
    s = AxisSampler.from_yaml()
    a = [s.sample(random.Random(7)) for _ in range(3)]
    b = [s.sample(random.Random(7)) for _ in range(3)]
    assert a == b
    r1, r2 = random.Random(1), random.Random(2)
    assert [s.sample(r1) for _ in range(20)] != [s.sample(r2) for _ in range(20)]


_GENERATE_ALL = """
import sys
from pathlib import Path
from tmax_jax.tasks.generator import ProceduralGenerator, all_families
g = ProceduralGenerator()
for fam in sorted(all_families()):
    g.generate_family(Path(sys.argv[1]) / fam, fam, 7, fmt="tmax")
"""


def test_generation_is_the_same_in_every_process(tmp_path):
    """A seed names one task: the same files whatever the interpreter's hash seed (set order)."""
    trees = []
    for hash_seed in ("1", "2"):
        out = tmp_path / hash_seed
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run([sys.executable, "-c", _GENERATE_ALL, str(out)], check=True, env=env, timeout=300)
        # espeak-ng's audio is not bit-reproducible; the audio family's answers come from the text.
        trees.append(
            {
                str(p.relative_to(out)): p.read_bytes()
                for p in sorted(out.rglob("*"))
                if p.is_file() and p.suffix != ".wav"
            }
        )
    assert len(trees[0]) > 100 and trees[0].keys() == trees[1].keys()
    assert [k for k in trees[0] if trees[0][k] != trees[1][k]] == []


@pytest.mark.parametrize("kind", ["legacy", "sft_v2", "rl_v2"])
def test_sampling_matches_configured_marginals(kind):
    s = AxisSampler.from_yaml(corpus_kind=kind)
    rng = random.Random(123)
    n = 6000
    draws = [s.sample(rng) for _ in range(n)]
    for axis, probs in s.marginals().items():
        probs = {v: p for v, p in probs.items() if p > 0}
        counts = collections.Counter(getattr(d, axis) for d in draws)
        assert set(counts) <= set(probs), f"{axis}: drew a zero-weight value"
        chi2 = sum((counts.get(v, 0) - n * p) ** 2 / (n * p) for v, p in probs.items())
        assert chi2 < CHI2_999[len(probs) - 1], f"{axis}: chi2 {chi2:.1f} for {dict(counts)}"
    # hierarchy: skills and personas always belong to the drawn domain
    for d in draws[:500]:
        dom = s.domains[d.domain]
        assert d.primitive_skill in dom["skills"][d.skill_type] and d.persona in dom["personas"]


def test_corpus_kinds_reweight_and_bad_configs_are_named():
    legacy = AxisSampler.from_yaml(corpus_kind="legacy").marginals()["task_complexity"]
    rl = AxisSampler.from_yaml(corpus_kind="rl_v2").marginals()["task_complexity"]
    assert rl["intricate"] > legacy["intricate"] and rl["short"] < legacy["short"]
    with pytest.raises(ConfigError, match="unknown corpus kind 'nope'"):
        AxisSampler.from_yaml(corpus_kind="nope")
    spec = {
        "domains": {"d": {"personas": ["p"], "skills": {"s": ["x"]}}},
        "axes": {},
        "corpus_kinds": {"k": {}},
    }
    with pytest.raises(ConfigError, match="missing axis 'fixture_kind'"):
        AxisSampler(spec, "k")
    with pytest.raises(ConfigError, match="unknown axis 'colour'"):
        AxisSampler.from_yaml().sample(random.Random(0), colour="red")


def test_families_cover_every_domain_and_verifier_kind():
    fams = all_families()
    s = AxisSampler.from_yaml()
    assert len(fams) >= 30
    assert {f.domain for f in fams.values()} == set(s.domains)
    assert {f.verifier_kind for f in fams.values()} == set(s.flat["verifier_kind"])
    assert {"image", "audio", "stripped_binary", "vendored_package", "multi_service_compose"} <= {
        f.fixture_kind for f in fams.values()
    }


def test_graders_give_partial_credit():
    assert graders.exact_text("a\nb\nc", "a\nb\nc") == 1.0
    assert 0 < graders.exact_text("a\nX\nc", "a\nb\nc") < 1
    assert graders.exact_text("", "a") == 0.0
    assert graders.metric_threshold(0.05, 0.1, 1.0, higher_is_better=False) == 1.0
    assert 0 < graders.metric_threshold(0.5, 0.1, 1.0, higher_is_better=False) < 1
    assert graders.metric_threshold(2.0, 0.1, 1.0, higher_is_better=False) == 0.0
    assert graders.metric_threshold(3.0, 4.0, 1.0) == pytest.approx(0.99 * 2 / 3)
    cases = [(1, True), (2, False), (3, True), (4, False)]
    assert graders.adversarial_corpus(lambda x: x % 2 == 1, cases) == 1.0
    assert graders.adversarial_corpus(lambda x: True, cases) == 0.5
    assert graders.adversarial_corpus(lambda x: 1 / 0, cases) == 0.0
    half = graders.fuzz_equivalence(lambda x: abs(x) if x > 0 else 0, abs, lambda r: r.randint(-9, 9), n=400)
    assert 0.3 < half < 0.7
    assert graders.multi_protocol({"a": lambda: True, "b": lambda: False}) == 0.5
    assert graders.relative_to_baseline(0.6, 0.2) == pytest.approx(0.99 * 0.5)


@pytest.fixture
def cfg(tmp_path):
    return SandboxConfig(cache_dir=str(tmp_path / "cache"))


def _params(task) -> dict:
    return json.loads((task.path / "task.json").read_text())["family_params"]


def _half_exact(task, sh):  # exact_text: the first line right, the rest wrong
    first = json.loads((task.path / "task.json").read_text())["truth"].splitlines()[0]
    sh.run(f"printf '%s\\nwrong\\n' '{first}' > {_params(task)['output']}")


def _half_metric(task, sh):  # relative error 0.5: half-way between the bound and the worst case
    p = _params(task)
    sh.run(f"echo {p['exact'] * 1.5!r} > {p['output']}")


def _half_corpus(task, sh):  # drop the century rule only: some hidden years still right
    sh.run(f"sed -i 's/year % 4 == 0 or year % 100 != 0/year % 4 == 0/' {_params(task)['module']}")


def _half_fuzz(task, sh):  # right on single-character runs only
    p = _params(task)
    fn = p["function"]
    body = f"def {fn}(s):\n    return (s[:1] + str(len(s))) if s and len(set(s)) == 1 else ''\n"
    sh.run(f"cat > {p['module']} <<'EOF'\n{body}EOF")


def _half_protocol(task, sh):  # HTTP right, the TCP protocol missing
    p = _params(task)
    code = (
        "import json\nfrom http.server import BaseHTTPRequestHandler, HTTPServer\n"
        "class H(BaseHTTPRequestHandler):\n    def do_GET(self):\n"
        f"        b = json.dumps({{'status': 'ok', 'name': '{p['name']}'}}).encode(); self.send_response(200); self.end_headers(); self.wfile.write(b)\n"
        f"HTTPServer(('127.0.0.1', {p['http_port']}), H).serve_forever()\n"
    )
    sh.run(f"cat > /tmp/h.py <<'EOF'\n{code}EOF\n( setsid python3 /tmp/h.py >/dev/null 2>&1 & ); sleep 1")


@pytest.mark.parametrize(
    "kind, family, agent",
    [
        ("exact_text", "unit_conversion", _half_exact),
        ("metric_threshold", "quadrature", _half_metric),
        ("adversarial_corpus", "leap_year_fix", _half_corpus),
        ("fuzz_equivalence", "rle_codec", _half_fuzz),
        ("multi_protocol", "http_tcp_service", _half_protocol),
    ],
)
def test_every_verifier_kind_gives_partial_credit_in_a_sandbox(tmp_path, cfg, kind, family, agent):
    task = load_task(_draft_dir(tmp_path, family, kind))
    assert task.signature["verifier_kind"] == kind
    res = run_task(task, agent, cfg)
    assert 0.0 < res.reward < 1.0 and not res.passed, f"{res.reward} {res.reason} {res.verifier_log[-500:]}"


def test_generated_tasks_of_every_family_pass_the_executability_filter(tmp_path, cfg):
    gen = ProceduralGenerator()
    # A hundred sampled draws are distinct and spread over the families (no sandbox needed for that).
    made = [gen.generate_one(tmp_path / "corpus", seed=11, index=i) for i in range(100)]
    prompts = [load_task(m.path).instruction for m in made]
    assert len(set(prompts)) == 100, "two draws produced the same task"
    for m in made[:5]:
        meta = json.loads((m.path / "task.json").read_text())
        assert meta["axes"] == m.signature and meta["family"] == m.family
    assert len({m.family for m in made}) >= 20
    # The filter runs one task of every family plus ten of the sampled draws (other parameters, the
    # tmax layout) through real sandboxes: each reference solution scores 1, each no-op 0.
    per_family = [gen.generate_family(tmp_path / "families", f, seed=5) for f in sorted(all_families())]
    assert len(per_family) == len(all_families()) >= 30
    checked = [m.path for m in per_family] + [m.path for m in made[:10]]
    results = filter_tasks(checked, cfg, concurrency=2)
    bad = [(Path(r.path).name, r.reason) for r in results if not r.kept]
    assert not bad, bad
    assert len(results) == len(checked)
    assert all(r.noop_reward == 0.0 and r.oracle_reward == 1.0 for r in results)


def test_filter_drops_broken_tasks(tmp_path, cfg):
    d = _draft_dir(tmp_path, "csv_group_sum", "broken")
    (d / "solutions" / "solve.sh").write_text("#!/bin/bash\necho nope > /dev/null\n")
    r = check_task(d, cfg)
    assert not r.kept and r.reason.startswith("reference solution scores 0")
    d2 = _draft_dir(tmp_path, "word_frequency", "noop-passes")
    (d2 / "test_final_state.py").write_text("def test_ok():\n    pass\n")
    r = check_task(d2, cfg)
    assert not r.kept and r.reason.startswith("no-op scores 1")
    d3 = _draft_dir(tmp_path, "date_rewrite", "bad-setup")
    (d3 / "setup.sh").write_text("#!/bin/bash\nexit 3\n")
    r = check_task(d3, cfg)
    assert not r.kept and r.reason.startswith("environment build failed")


def test_generate_tasks_cli_both_formats(tmp_path):
    for fmt in ("tmax", "harbor"):
        out = tmp_path / fmt
        r = subprocess.run(
            [sys.executable, "-m", "tmax_jax", "generate-tasks", "--n", "3", "--out", str(out), "--seed", "3", "--format", fmt, "--concurrency", "2"],
            capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "TMAX_JAX_CACHE": str(tmp_path / "cache")},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "3/3 tasks kept" in r.stdout
        report = json.loads((out / "generation_report.json").read_text())
        assert report["kept"] == 3 and all(t["kept"] for t in report["tasks"])
        first = load_task(next(p for p in sorted(out.iterdir()) if p.is_dir()))
        assert first.format == fmt


def test_corpus_stats_tables_and_plots(tmp_path):
    from PIL import Image

    from tmax_jax.figures import WIDTH_IN
    from tmax_jax.tasks.stats import corpus_stats

    gen = ProceduralGenerator()
    made = [gen.generate_one(tmp_path / "c", seed=5, index=i) for i in range(12)]
    report = corpus_stats(tmp_path / "c", tmp_path / "plots")
    assert report["tasks"] == 12
    for axis, counts in report["axes"].items():
        assert sum(counts.values()) == 12, axis
    assert report["axes"]["domain"] == dict(collections.Counter(m.signature["domain"] for m in made))
    for p in report["plots"]:
        with Image.open(p) as im:
            assert im.size[0] == round(WIDTH_IN * 100) and im.size[1] > 50
    r = subprocess.run(
        [sys.executable, "-m", "tmax_jax", "corpus-stats", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "12 tasks in" in r.stdout and "verifier_kind" in r.stdout and "difficulty by domain" in r.stdout
    assert (tmp_path / "c" / "stats" / "domain.png").is_file()


def test_thirteen_gram_decontamination(tmp_path):
    from tmax_jax.tasks.decontam import find_contaminated, ngrams

    gen = ProceduralGenerator()
    made = [gen.generate_one(tmp_path / "corpus", seed=9, index=i) for i in range(6)]
    leaked = load_task(made[2].path).instruction
    bench = tmp_path / "bench" / "leaky"
    (bench / "tests").mkdir(parents=True)
    words = leaked.split()
    (bench / "instruction.md").write_text("Benchmark task. " + " ".join(words[3:20]) + " and more.\n")
    (bench / "task.toml").write_text(
        "[verifier]\ntimeout_sec = 10\n[environment]\ndocker_image = 'ubuntu:24.04'\n"
    )
    (bench / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    hits = find_contaminated(tmp_path / "corpus", tmp_path / "bench")
    assert [h.path.name for h in hits] == [made[2].path.name]
    assert len(ngrams("one two three", 2)) == 2 and ngrams("too short", 13) == set()


def test_calibration_pass_rates_and_difficulty_band(tmp_path, cfg):
    from tmax_jax.tasks.calibrate import calibrate, in_band
    from tmax_jax.tasks.runner import run_oracle

    gen = ProceduralGenerator()
    made = [gen.generate_one(tmp_path / "c", seed=21, index=i) for i in range(2)]
    calls = []

    def sometimes(task, sh):  # solves every other attempt: pass rate 1/2
        calls.append(task.name)
        if len(calls) % 2:
            run_oracle(task, sh.sandbox)

    res = calibrate([m.path for m in made], sometimes, k=2, cfg=cfg, concurrency=1)
    assert [r.pass_rate for r in res] == [0.5, 0.5] and all(len(r.rewards) == 2 for r in res)
    assert len(in_band(res)) == 2
    oracle = calibrate([m.path for m in made], "oracle", k=2, cfg=cfg, concurrency=2)
    assert [r.pass_rate for r in oracle] == [1.0, 1.0] and in_band(oracle) == []
    out = tmp_path / "calib.json"
    r = subprocess.run(
        [sys.executable, "-m", "tmax_jax", "calibrate", str(tmp_path / "c"), "--agent", "noop", "-k", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "TMAX_JAX_CACHE": cfg.cache_dir},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert [t["pass_rate"] for t in report["tasks"]] == [0.0, 0.0] and not any(
        t["in_band"] for t in report["tasks"]
    )
    assert "0/2 tasks in the band" in r.stdout


# A candidate module that attacks the grader loading it instead of solving: from its own scope it
# walks to the caller's globals and makes every grading helper answer 1.0, writes a full reward
# into the reward file, and kills the process that loaded it (so that nothing overwrites that file).
ATTACKING_MODULE = """
import os, sys
f = sys._getframe(0)
while f is not None:
    for k, v in list(f.f_globals.items()):
        if callable(v) and k in ("adversarial_corpus", "fuzz_equivalence", "relative_to_baseline"):
            f.f_globals[k] = lambda *a, **kw: 1.0
    f = f.f_back
try:
    os.makedirs("/logs/verifier", exist_ok=True)
    with open("/logs/verifier/reward.txt", "w") as out:
        out.write("1.000000")
    os.kill(os.getppid(), 9)
except OSError:
    pass
def is_secret(line):
    return line.startswith("key=")
"""


def _fair_share(d: Path, predict) -> float:
    """What ``predict`` earns on a secret_scanner task's cases under its grading (credit above the
    best constant answer), computed from the cases its test file holds."""
    src = (d / "test_final_state.py").read_text()
    line = next(x for x in src.splitlines() if x.strip().startswith("cases = ["))
    cases = ast.literal_eval(line.split("=", 1)[1].strip())
    share = sum(predict(x) == want for x, want in cases) / len(cases)
    base = max(sum(want is c for _, want in cases) / len(cases) for c in (True, False))
    return graders.relative_to_baseline(share, base)


def test_a_candidate_module_that_attacks_its_grader_scores_what_its_function_earns(tmp_path, cfg):
    """The code families load the agent's module to grade it: its code runs on import. Graded in a
    process of its own as an unprivileged user, it earns what ``is_secret`` (lines starting "key=")
    earns on the cases, computed here from the task's cases, and no more (in the grader's process
    it scored 1.0)."""
    d = _draft_dir(tmp_path, "secret_scanner", "attack")
    solve = (d / "solutions" / "solve.sh").read_text()
    mod = solve.split("cat > ", 1)[1].split()[0]
    (d / "solutions" / "solve.sh").write_text(
        f"#!/bin/bash\nmkdir -p $(dirname {mod})\ncat > {mod} <<'EOF'\n{ATTACKING_MODULE}EOF\n"
    )
    task = load_task(d)
    fair = _fair_share(d, lambda line: line.startswith("key="))
    res = run_task(task, "oracle", cfg)
    assert 0.0 < fair < 1.0 and res.reward == pytest.approx(fair, abs=1e-6), (
        res.reason,
        res.verifier_log[-800:],
    )
    assert not res.passed


def test_a_makefile_that_attacks_its_grader_scores_zero(tmp_path, cfg):
    """The build family's grader runs the agent's Makefile: one that writes a full reward into the
    reward file and kills the grader's pytest (so that nothing overwrites that file) instead of
    building. Run on a copy as an unprivileged user, it can do neither (as root it scored 1.0)."""
    d = _draft_dir(tmp_path, "makefile_fix", "attack")
    solve = (d / "solutions" / "solve.sh").read_text()
    w = next(x for x in solve.splitlines() if x.startswith("cd ")).split()[1]
    attack = (
        "app:\n\tmkdir -p /logs/verifier; echo 1.000000 > /logs/verifier/reward.txt; "
        "for p in $$(pgrep -f pytest); do kill -9 $$p; done\n\nclean:\n\ttrue\n"
    )
    (d / "solutions" / "solve.sh").write_text(f"#!/bin/bash\ncat > {w}/Makefile <<'EOF'\n{attack}EOF\n")
    res = run_task(load_task(d), "oracle", cfg)
    assert res.reward == 0.0 and not res.passed, (res.reason, res.verifier_log[-800:])


# A candidate module that reads its answers instead of computing them: the graders hold their cases
# as literals in /tests/test_final_state.py, and this works for every function family alike.
READING_MODULE = """
import ast, os
table = {}
try:
    names = os.listdir("/tests")
except OSError:
    names = ["test_final_state.py"]
for name in names:
    try:
        tree = ast.parse(open("/tests/" + name).read())
    except (OSError, SyntaxError, ValueError):
        continue
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:
            try:
                table[ast.literal_eval(node.elts[0])] = ast.literal_eval(node.elts[1])
            except (ValueError, TypeError):
                pass
def is_secret(line):
    return table.get(line, line.startswith("key="))
"""


def test_a_candidate_module_cannot_read_the_tests(tmp_path, cfg):
    """The tests of a generated task are the verifier's (mode 0700 for the sandbox's root): the
    agent's module, graded as an unprivileged user, cannot read its cases from them and earns what
    its fallback (lines starting "key=") earns, computed here from the task's cases (it read all of
    them and scored 1.0 while /tests was readable by all)."""
    d = _draft_dir(tmp_path, "secret_scanner", "reader")
    solve = (d / "solutions" / "solve.sh").read_text()
    mod = solve.split("cat > ", 1)[1].split()[0]
    (d / "solutions" / "solve.sh").write_text(
        f"#!/bin/bash\nmkdir -p $(dirname {mod})\ncat > {mod} <<'EOF'\n{READING_MODULE}EOF\n"
    )
    fair = _fair_share(d, lambda line: line.startswith("key="))
    res = run_task(load_task(d), "oracle", cfg)
    assert 0.0 < fair < 1.0 and res.reward == pytest.approx(fair, abs=1e-6), (
        res.reason,
        res.verifier_log[-800:],
    )


def test_a_graded_module_imports_the_standard_library(tmp_path, cfg):
    """The grader runs the agent's module as an unprivileged user: a module importing standard
    library modules the grader's child had not loaded yet (json, glob, textwrap) still scores 1.0,
    wherever the host's Python lives (here under /root, whose dirs bwrap made 0700)."""
    d = _draft_dir(tmp_path, "secret_scanner", "stdlib")
    solve = (d / "solutions" / "solve.sh").read_text()
    mod = solve.split("cat > ", 1)[1].split()[0]
    text = solve.replace(
        f"cat > {mod} <<'EOF'\n", f"cat > {mod} <<'EOF'\nimport glob, json, textwrap  # noqa\n", 1
    )
    assert text != solve
    (d / "solutions" / "solve.sh").write_text(text)
    res = run_task(load_task(d), "oracle", cfg)
    assert (res.reward, res.passed) == (1.0, True), (res.reason, res.verifier_log[-800:])
