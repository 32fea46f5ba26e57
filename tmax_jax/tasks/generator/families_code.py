"""Families: security, software engineering, debugging."""

from __future__ import annotations

import hashlib
import re
import subprocess
import tempfile
import textwrap
from pathlib import Path

from tmax_jax.tasks.generator.base import (
    COMPLEXITY_SCALE,
    WORDS,
    Family,
    TaskDraft,
    copy_fixtures_setup,
    exact_text_check,
    files_exist_test,
    ident,
    persona_prompt,
    word,
    workdir,
)
from tmax_jax.tasks.generator.registry import register

# The agent's module is graded in a process of its own, as an unprivileged user when the verifier
# runs as root: its code (which runs on import) can neither rewrite the grader's functions in memory
# (a frame walk to the caller's globals would) nor write the reward file. Calls and results cross a
# pipe as Python literals (``ast.literal_eval``: no code, no pickle); an error in the module's call
# raises ``ModuleCallError`` in the grader, which scores that case wrong. The child drops to 65534
# itself once started (not ``Popen(user=...)`` as ``graders.run_untrusted`` does): the verifier's
# interpreter may live where only root can reach it (a Python under /root).
LOAD = '''
import ast as _ast
import subprocess as _sp
import sys as _sys_l
_CHILD = """
import ast, importlib.util, os, sys
proto = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what the module prints goes to stderr, never into the protocol
path, name, extra = sys.argv[1], sys.argv[2], ast.literal_eval(sys.argv[3])
sys.path[:0] = [p for p in extra if p not in sys.path]
if os.getuid() == 0:
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    except OSError:
        pass
def send(text):
    proto.write(text + chr(10))
    proto.flush()
try:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
except BaseException as e:
    send(repr(("err", type(e).__name__, str(e)[:300])))
    sys.exit(0)
send(repr(("ok", sorted(n for n in dir(mod) if not n.startswith("__")))))
for line in sys.stdin:
    fn, args, kwargs = ast.literal_eval(line)
    try:
        text = repr(("ok", getattr(mod, fn)(*args, **kwargs)))
        ast.literal_eval(text)
    except BaseException as e:
        text = repr(("err", type(e).__name__, str(e)[:300]))
    send(text)
"""
class ModuleCallError(Exception):
    pass
class _Remote:
    def __init__(self, path, name, extra=()):
        self._p = _sp.Popen(
            [_sys_l.executable, "-c", _CHILD, path, name, repr([*extra, *_sys_l.path])],
            stdin=_sp.PIPE, stdout=_sp.PIPE, text=True,
        )
        kind, *rest = self._reply()
        if kind != "ok":
            raise ImportError(f"{path}: {rest[0]}: {rest[1]}")
        self._names = set(rest[0])
    def _reply(self):
        line = self._p.stdout.readline()
        if not line:
            raise ModuleCallError("the module's process ended")
        reply = _ast.literal_eval(line)
        if not isinstance(reply, tuple) or not reply or reply[0] not in ("ok", "err"):
            raise ModuleCallError("the module's process sent something that is not a reply")
        return reply
    def __getattr__(self, fn):
        if fn.startswith("_") or fn not in self._names:
            raise AttributeError(fn)
        def call(*args, **kwargs):
            self._p.stdin.write(repr((fn, args, kwargs)) + chr(10))
            self._p.stdin.flush()
            reply = self._reply()
            if reply[0] == "ok" and len(reply) == 2:
                return reply[1]
            raise ModuleCallError(f"{fn}: {reply[1:]}")
        return call
def _load(path, name, extra=()):
    return _Remote(path, name, extra)
'''


# Shared verifier snippets, indented like the f-string checks below so that one dedent fits all.
LOAD = textwrap.indent(LOAD, " " * 12)


def _alnum(rng, n, alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"):
    return "".join(rng.choice(alphabet) for _ in range(n))


@register
class SecretScanner(Family):
    name, domain, skill_type, primitive_skill = (
        "secret_scanner",
        "security",
        "secrets_detection",
        "regex_scan",
    )
    verifier_kind = "adversarial_corpus"

    @staticmethod
    def _cases(rng, prefix, n):
        good = [f"{prefix}{_alnum(rng, n)}" for _ in range(6)]
        cases = [(f"key={g}", True) for g in good[:2]] + [
            (f"{word(rng)} {g} {word(rng)}", True) for g in good[2:4]
        ]
        cases += [(f"{prefix}{_alnum(rng, n - 1)}", False), (f"{prefix}{_alnum(rng, n + 1)}", False)]
        cases += [
            (f"{prefix.lower()}{_alnum(rng, n)}", False),
            (f"X{good[4]}", False),
            (f"{good[5]}Z", False),
        ]
        cases += [(f"{prefix}{_alnum(rng, n - 2)}ab", False), (f"({good[5]})", True), (ident(rng, 4), False)]
        return cases

    def make(self, rng, sig):
        w = workdir(rng)
        prefix = rng.choice(["AKIA", "TMXK", "SKEY"])
        n = rng.choice([16, 20])
        mod = f"{w}/scanner.py"
        cases = self._cases(rng, prefix, n)

        # The samples fixture shows the same kinds of lines, drawn afresh: none of its keys is in a
        # graded case, so a module that memorises the samples earns what its fallback earns (they
        # were the grader's first six cases, answers included: a lookup table scored 0.917).
        def tokens(lines):
            return {t for x, _ in lines for t in re.findall(r"[A-Za-z0-9]{8,}", x)}

        while True:
            shown = self._cases(rng, prefix, n)
            shown = shown[:4] + shown[4:6]
            if not tokens(shown) & tokens(cases):
                break
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            Write {mod} defining is_secret(line: str) -> bool. A line holds a secret when it contains a
            token that starts with '{prefix}' followed by exactly {n} characters from A-Z and 0-9, and the
            token is not glued to further letters or digits on either side. Sample lines are in
            {w}/samples.txt (one per line, with the expected answer after a tab).""",
        )
        samples = "".join(f"{x}\t{y}\n" for x, y in shown)
        solve = f"""cat > {mod} <<'EOF'
import re
_PAT = re.compile(r'(?<![A-Za-z0-9]){prefix}[A-Z0-9]{{{n}}}(?![A-Za-z0-9])')
def is_secret(line):
    return _PAT.search(line) is not None
EOF"""
        check = (
            LOAD
            + f"""
            from pathlib import Path
            def grade():
                if not Path({mod!r}).is_file():
                    return 0.0
                try:
                    m = _load({mod!r}, 'scanner')
                except Exception:
                    return 0.0
                cases = {cases!r}
                # Credit only above the best constant answer (always False was right on 7 of 12).
                base = max(adversarial_corpus(lambda x: c, cases) for c in (True, False))
                return relative_to_baseline(adversarial_corpus(m.is_secret, cases), base)
            """
        )
        return self.in_workdir(w, prompt, solve, textwrap.dedent(check), {"samples.txt": samples}, [mod])


@register
class HashCrack(Family):
    name, domain, skill_type, primitive_skill = "hash_crack", "security", "credential_audit", "hash_cracking"

    def make(self, rng, sig):
        w = workdir(rng)
        words = rng.sample(WORDS, 20 + 5 * COMPLEXITY_SCALE[sig.task_complexity])
        users = sorted(
            {f"{word(rng)}{rng.randint(1, 99)}" for _ in range(2 + COMPLEXITY_SCALE[sig.task_complexity])}
        )
        pw = {u: rng.choice(words) + str(rng.randint(0, 9)) for u in users}
        wordlist = sorted({*(p for p in pw.values()), *(x + str(rng.randint(0, 9)) for x in words)})
        shadow = "".join(f"{u}:{hashlib.sha256(pw[u].encode()).hexdigest()}\n" for u in users)
        truth = "\n".join(f"{u}:{pw[u]}" for u in users)
        out = f"{w}/cracked.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/hashes.txt lists 'user:sha256-hex' entries for an authorized audit. Every password is in
            {w}/wordlist.txt. Write {out} with 'user:password' lines, sorted by user.""",
        )
        solve = f"""python3 - <<'EOF'
import hashlib
words = open('{w}/wordlist.txt').read().split()
table = {{hashlib.sha256(x.encode()).hexdigest(): x for x in words}}
rows = [l.split(':') for l in open('{w}/hashes.txt').read().split()]
open('{out}', 'w').write(''.join(f'{{u}}:{{table[h]}}\\n' for u, h in sorted(rows)))
EOF"""
        check = exact_text_check(out, truth)
        fixtures = {"hashes.txt": shadow, "wordlist.txt": "\n".join(wordlist) + "\n"}
        return self.in_workdir(w, prompt, solve, check, fixtures, [out], truth, inputs=[f"{w}/hashes.txt"])


@register
class StrippedBinaryPassword(Family):
    name, domain, skill_type, primitive_skill = (
        "stripped_binary_password",
        "security",
        "reverse_engineering",
        "binary_probing",
    )
    fixture_kind = "stripped_binary"
    command_complexity = "bash-only"

    def make(self, rng, sig):
        w = workdir(rng)
        pw = f"{word(rng)}-{_alnum(rng, 6, 'abcdefghijkmnpqrstuvwxyz23456789')}"
        decoys = [
            f"{word(rng)}-{_alnum(rng, 6, 'abcdefghijkmnpqrstuvwxyz23456789')}"
            for _ in range(2 + COMPLEXITY_SCALE[sig.task_complexity])
        ]
        src = "#include <stdio.h>\n#include <string.h>\n"
        src += "".join(f'const char *decoy{i} = "{d}";\n' for i, d in enumerate(decoys))
        src += f'int main(int c, char **v) {{ if (c > 1 && strcmp(v[1], "{pw}") == 0) {{ puts("ACCESS GRANTED"); return 0; }}\n'
        src += '  puts("denied"); return 1; }\n'
        src += "".join(f"void use{i}(void) {{ puts(decoy{i}); }}\n" for i in range(len(decoys)))
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "v.c").write_text(src)
            subprocess.run(
                ["gcc", "-O1", "-s", "-o", str(Path(tmp) / "vault"), str(Path(tmp) / "v.c")],
                check=True,
                capture_output=True,
            )
            blob = (Path(tmp) / "vault").read_bytes()
        out = f"{w}/password.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/vault is a stripped binary that prints 'ACCESS GRANTED' when run with the right password as
            its only argument. Find that password and write it to {out}.""",
        )
        solve = f'cd {w}\nfor s in $(strings -n 6 vault | grep -E \'^[a-z]+-[a-z0-9]{{6}}$\'); do if ./vault "$s" | grep -q GRANTED; then echo "$s" > {out}; fi; done\n'
        check = exact_text_check(out, pw)
        setup = copy_fixtures_setup(w) + f"chmod 755 {w}/vault\n"
        return TaskDraft(
            self.name,
            prompt,
            solve,
            check,
            files_exist_test([f"{w}/vault"], [out]),
            setup,
            {"vault": blob},
            pw,
        )


RLE_REF = """
def _ref_encode(s):
    out, i = [], 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        out.append(f"{s[i]}{j - i}")
        i = j
    return "".join(out)
"""

RLE_REF = textwrap.indent(RLE_REF, " " * 12)


@register
class RleCodec(Family):
    name, domain, skill_type, primitive_skill = (
        "rle_codec",
        "software_engineering",
        "implementation",
        "text_codec",
    )
    verifier_kind = "fuzz_equivalence"

    def make(self, rng, sig):
        w = workdir(rng)
        fn = rng.choice(["rle_encode", "compress_runs", "encode_runs"])
        mod = f"{w}/{ident(rng)}.py"
        alphabet = "".join(rng.sample("abcdefghxyz", 3 + COMPLEXITY_SCALE[sig.task_complexity]))
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            Create {mod} with a function {fn}(s: str) -> str doing run-length encoding: each maximal run
            of one character becomes the character followed by the run length in decimal, e.g.
            'aaab' -> 'a3b1', '' -> ''. Inputs use only the letters '{alphabet}'.""",
        )
        solve = f"cat > {mod} <<'EOF'\nimport itertools\ndef {fn}(s):\n    return ''.join(f'{{k}}{{len(list(g))}}' for k, g in itertools.groupby(s))\nEOF\n"
        check = (
            LOAD
            + RLE_REF
            + f"""
            from pathlib import Path
            # At least one run: a module that always returns '' was right on every empty draw.
            def _gen(rng):
                return ''.join(rng.choice({alphabet!r}) * rng.randint(1, 12) for _ in range(rng.randint(1, 8)))
            def grade():
                if not Path({mod!r}).is_file():
                    return 0.0
                try:
                    m = _load({mod!r}, 'cand')
                    cand = getattr(m, {fn!r})
                except Exception:
                    return 0.0
                return fuzz_equivalence(cand, _ref_encode, _gen, n=300, seed={rng.randint(0, 10**6)})
            """
        )
        draft = TaskDraft(
            self.name,
            prompt,
            solve,
            textwrap.dedent(check),
            files_exist_test([], [mod]),
            f"mkdir -p {w}\n",
            {},
        )
        draft.params = {"module": mod, "function": fn}
        return draft


SLUG_REF = """
import re as _re
def _ref_slug(s):
    s = _re.sub(r"[^a-z0-9]+", "-", s.lower())
    return s.strip("-")
"""

SLUG_REF = textwrap.indent(SLUG_REF, " " * 12)


@register
class VendoredSlugify(Family):
    name, domain, skill_type, primitive_skill = (
        "vendored_slugify",
        "software_engineering",
        "packaging",
        "vendored_fix",
    )
    verifier_kind = "fuzz_equivalence"
    fixture_kind = "vendored_package"

    def make(self, rng, sig):
        w = workdir(rng)
        pkg = f"{word(rng)}kit"
        buggy = 'def slugify(s):\n    """Lower-case, runs of non [a-z0-9] -> one dash, no leading/trailing dash."""\n    return s.lower().replace(" ", "-")\n'
        fixtures = {
            f"vendor/{pkg}/__init__.py": "from .text import slugify\n",
            f"vendor/{pkg}/text.py": buggy,
            "app.py": f"import sys\nsys.path.insert(0, 'vendor')\nfrom {pkg} import slugify\nprint(slugify(sys.argv[1]))\n",
        }
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/app.py uses the vendored package {w}/vendor/{pkg}. Its slugify() is wrong: fix the package
            so slugify lower-cases the text, turns every run of characters outside [a-z0-9] into a single
            '-', and strips leading and trailing dashes (e.g. '  Hello, World!! ' -> 'hello-world').""",
        )
        solve = f"""cat > {w}/vendor/{pkg}/text.py <<'EOF'
import re
def slugify(s):
    return re.sub(r'[^a-z0-9]+', '-', s.lower()).strip('-')
EOF"""
        check = (
            LOAD
            + SLUG_REF
            + f"""
            def _gen(rng):
                return ''.join(rng.choice('aZ9 -_!.,?xY') for _ in range(rng.randint(0, 20)))
            def grade():
                try:
                    # vendor/ goes on the path of the module's own process only: on the verifier's,
                    # a module it imported later would come from the agent's dir (and run as root).
                    m = _load({f"{w}/vendor/{pkg}/__init__.py"!r}, {pkg!r}, [{w + "/vendor"!r}])
                except Exception:
                    return 0.0
                seed = {rng.randint(0, 10**6)}
                base_ns = {{}}
                exec({buggy!r}, base_ns)
                base = fuzz_equivalence(base_ns['slugify'], _ref_slug, _gen, n=300, seed=seed)
                return relative_to_baseline(fuzz_equivalence(m.slugify, _ref_slug, _gen, n=300, seed=seed), base)
            """
        )
        return self.in_workdir(
            w, prompt, solve, textwrap.dedent(check), fixtures, [], inputs=[f"{w}/vendor/{pkg}/text.py"]
        )


@register
class OffByOne(Family):
    name, domain, skill_type, primitive_skill = "off_by_one_fix", "debugging", "logic_errors", "off_by_one"
    verifier_kind = "fuzz_equivalence"

    def make(self, rng, sig):
        w = workdir(rng)
        fn = rng.choice(["window_sums", "rolling_totals", "sliding_sum"])
        mod = f"{w}/stats_{word(rng)}.py"
        buggy = f'def {fn}(xs, k):\n    """Sums of every window of k consecutive items."""\n    return [sum(xs[i:i + k]) for i in range(len(xs) - k)]\n'
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {fn}(xs, k) in {mod} should return the sums of every window of k consecutive items of xs
            (len(xs) - k + 1 values; [] when k > len(xs)), but users report it drops a window. Fix it
            without changing its name or signature.""",
        )
        solve = f"sed -i 's/range(len(xs) - k)/range(len(xs) - k + 1)/' {mod}\n"
        check = (
            LOAD
            + f"""
            from pathlib import Path
            def _ref(a):
                xs, k = a
                return [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]
            def _gen(rng):
                return ([rng.randint(-9, 9) for _ in range(rng.randint(0, 12))], rng.randint(1, 6))
            def grade():
                try:
                    f = getattr(_load({mod!r}, 'cand'), {fn!r})
                except Exception:
                    return 0.0
                seed = {rng.randint(0, 10**6)}
                base_ns = {{}}
                exec({buggy!r}, base_ns)
                base = fuzz_equivalence(lambda a: base_ns[{fn!r}](*a), _ref, _gen, n=300, seed=seed)
                return relative_to_baseline(fuzz_equivalence(lambda a: f(*a), _ref, _gen, n=300, seed=seed), base)
            """
        )
        return self.in_workdir(
            w, prompt, solve, textwrap.dedent(check), {Path(mod).name: buggy}, [], inputs=[mod]
        )


@register
class LeapYearFix(Family):
    name, domain, skill_type, primitive_skill = "leap_year_fix", "debugging", "logic_errors", "wrong_operator"
    verifier_kind = "adversarial_corpus"

    def make(self, rng, sig):
        w = workdir(rng)
        mod = f"{w}/calendar_{word(rng)}.py"
        buggy = "def is_leap(year):\n    return year % 4 == 0 or year % 100 != 0\n"
        years = sorted(
            {1900, 2000, 2100, 2400, 1996, 2023, 1800, 1600, *(rng.randint(1, 3000) for _ in range(12))}
        )
        cases = [(y, (y % 4 == 0 and y % 100 != 0) or y % 400 == 0) for y in years]
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            is_leap(year) in {mod} gives wrong answers. Fix it to follow the Gregorian rule (divisible by
            4, except centuries, except centuries divisible by 400).""",
        )
        solve = f"cat > {mod} <<'EOF'\ndef is_leap(year):\n    return (year % 4 == 0 and year % 100 != 0) or year % 400 == 0\nEOF\n"
        check = (
            LOAD
            + f"""
            def grade():
                try:
                    m = _load({mod!r}, 'cand')
                except Exception:
                    return 0.0
                base_ns = {{}}
                exec({buggy!r}, base_ns)
                cases = {cases!r}
                # The buggy code answers True for every year: credit starts above the better of it and
                # the best constant answer (always False earned up to 0.743 against the buggy code).
                base = max(adversarial_corpus(f, cases) for f in (base_ns['is_leap'], lambda y: True, lambda y: False))
                return relative_to_baseline(adversarial_corpus(m.is_leap, cases), base)
            """
        )
        draft = self.in_workdir(
            w, prompt, solve, textwrap.dedent(check), {Path(mod).name: buggy}, [], inputs=[mod]
        )
        draft.params = {"module": mod}
        return draft


@register
class DurationParserFix(Family):
    name, domain, skill_type, primitive_skill = (
        "duration_parser_fix",
        "debugging",
        "crash_analysis",
        "exception_fix",
    )
    verifier_kind = "adversarial_corpus"

    def make(self, rng, sig):
        w = workdir(rng)
        mod = f"{w}/durations.py"
        buggy = "def parse_duration(s):\n    h, m = s.split('h')\n    return int(h) * 3600 + int(m.rstrip('m')) * 60\n"
        cases = [
            ("1h30m", 5400),
            ("2h", 7200),
            ("45m", 2700),
            ("10s", 10),
            ("1h2m3s", 3723),
            ("0m", 0),
            ("3h0m15s", 10815),
        ]
        cases += [
            (f"{h}h{m}m", h * 3600 + m * 60)
            for h, m in ((rng.randint(0, 30), rng.randint(0, 59)) for _ in range(5))
        ]
        cases += [("", None), ("5x", None), ("h", None), ("1h1h", None)]
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            parse_duration(s) in {mod} crashes on many inputs. It must accept strings made of optional
            '<n>h', '<n>m', '<n>s' parts in that order (at least one part) and return seconds as an int;
            for anything else (empty, unknown units, repeated units) it must return None instead of raising.""",
        )
        solve = f"""cat > {mod} <<'EOF'
import re
_PAT = re.compile(r'(?:(\\d+)h)?(?:(\\d+)m)?(?:(\\d+)s)?')
def parse_duration(s):
    m = _PAT.fullmatch(s)
    if not s or m is None:
        return None
    h, mi, se = (int(g) if g else 0 for g in m.groups())
    return h * 3600 + mi * 60 + se
EOF"""
        check = (
            LOAD
            + f"""
            def grade():
                try:
                    m = _load({mod!r}, 'cand')
                except Exception:
                    return 0.0
                base_ns = {{}}
                exec({buggy!r}, base_ns)
                buggy = base_ns['parse_duration']
                def wrapped(s):  # the buggy code with its exceptions swallowed: no fix at all
                    try:
                        return buggy(s)
                    except Exception:
                        return None
                # An answer counts when its type is right too (False == 0, 5400.0 == 5400 do not).
                cases = [(x, (type(want), want)) for x, want in {cases!r}]
                def score(f):
                    return adversarial_corpus(lambda x: (lambda got: (type(got), got))(f(x)), cases)
                # Credit starts above the best of the buggy code, that code wrapped in a try/except
                # returning None (it scored 0.396) and the best constant answer (None).
                base = max(score(buggy), score(wrapped), score(lambda s: None))
                return relative_to_baseline(score(m.parse_duration), base)
            """
        )
        return self.in_workdir(
            w, prompt, solve, textwrap.dedent(check), {"durations.py": buggy}, [], inputs=[mod]
        )
