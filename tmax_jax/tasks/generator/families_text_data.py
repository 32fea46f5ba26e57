"""Families: system administration, text processing, data science."""

from __future__ import annotations

import csv
import io
import math
import sqlite3
import subprocess
import tempfile
import wave
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

LEVELS = ["INFO", "WARN", "ERROR", "DEBUG"]


@register
class LogErrorCount(Family):
    name, domain, skill_type, primitive_skill = (
        "log_error_count",
        "system_administration",
        "log_analysis",
        "grep_count",
    )
    command_complexity = "bash-only"

    def make(self, rng, sig):
        w = workdir(rng)
        n_files = 2 + COMPLEXITY_SCALE[sig.task_complexity]
        level = rng.choice(["ERROR", "WARN"])
        fixtures, expected = {}, []
        for name in sorted({f"{word(rng)}-{i}.log" for i in range(n_files)}):
            lines = [
                f"2024-0{rng.randint(1, 9)}-1{rng.randint(0, 9)} {rng.choice(LEVELS)} {ident(rng, 3)}"
                for _ in range(rng.randint(5, 40))
            ]
            fixtures[name] = "\n".join(lines) + "\n"
            expected.append(f"{name}: {sum(f' {level} ' in line + ' ' for line in lines)}")
        out = f"{w}/{level.lower()}_report.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            The logs in {w} (*.log) have lines like '<date> <LEVEL> <message>'. For every log file count
            the lines whose level is {level} and write {out} with one line per file, '<file name>: <count>',
            sorted by file name.""",
        )
        solve = f'cd {w}\nfor f in $(ls *.log | sort); do echo "$f: $(awk \'$2 == "{level}"\' "$f" | wc -l)"; done > {out}\n'
        check = exact_text_check(out, chr(10).join(expected))
        return self.in_workdir(
            w,
            prompt,
            solve,
            check,
            fixtures,
            [out],
            "\n".join(expected),
        )


@register
class PermissionFix(Family):
    name, domain, skill_type, primitive_skill = (
        "permission_fix",
        "system_administration",
        "filesystem",
        "permission_fix",
    )
    command_complexity = "bash-only"

    def make(self, rng, sig):
        w = workdir(rng)
        rules = {".sh": 0o750, ".key": 0o600, ".txt": 0o644}
        names = {
            f"{ident(rng)}{rng.choice(list(rules))}"
            for _ in range(3 + 2 * COMPLEXITY_SCALE[sig.task_complexity])
        }
        fixtures = {n: f"# {n}\n" for n in sorted(names)}
        setup = copy_fixtures_setup(w) + f"chmod 666 {w}/*\n"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            Fix the permissions in {w}: every *.sh must be mode 750, every *.key mode 600 and every *.txt
            mode 644. Do not rename, delete or edit the files.""",
        )
        solve = f"cd {w}\nchmod 750 *.sh 2>/dev/null || true\nchmod 600 *.key 2>/dev/null || true\nchmod 644 *.txt 2>/dev/null || true\n"
        want = {f"{w}/{n}": rules[Path(n).suffix] for n in sorted(names)}
        check = f"""
            import os, stat
            def grade():
                want = {want!r}
                ok = sum(1 for p, m in want.items() if os.path.exists(p) and stat.S_IMODE(os.stat(p).st_mode) == m)
                return ok / len(want) if ok < len(want) else 1.0
            """
        init = (
            files_exist_test(list(want))
            + f"\n\ndef test_all_wrong_first():\n    import os, stat\n    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o666 for p in {list(want)!r})\n"
        )
        return TaskDraft(self.name, prompt, solve, check, init, setup, fixtures)


@register
class DuplicateFinder(Family):
    name, domain, skill_type, primitive_skill = (
        "duplicate_finder",
        "system_administration",
        "filesystem",
        "duplicate_finder",
    )
    command_complexity = "bash-only"

    def make(self, rng, sig):
        w = workdir(rng)
        k = COMPLEXITY_SCALE[sig.task_complexity]
        fixtures, groups = {}, []
        for g in range(1 + k):
            body = f"{ident(rng, 4)} {rng.random()}\n"
            members = sorted(
                {f"{rng.choice(['a', 'b', 'c'])}/{word(rng)}{g}{i}.dat" for i in range(rng.randint(2, 3))}
            )
            for m in members:
                fixtures[m] = body
            if len(members) > 1:
                groups.append(" ".join(members))
        for i in range(2 + k):
            fixtures[f"uniq/{word(rng)}{i}.dat"] = f"unique {i} {rng.random()}\n"
        out = f"{w}.duplicates.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            Find files with identical content under {w} (recursively). Write {out} with one line per group
            of duplicates: the paths relative to {w}, sorted and separated by single spaces; sort the lines.
            Files with unique content are not listed.""",
        )
        solve = f"""cd {w}
python3 - <<'EOF'
import hashlib, os, collections
g = collections.defaultdict(list)
for root, _, files in os.walk('.'):
    for f in files:
        p = os.path.join(root, f)[2:]
        g[hashlib.sha256(open(p, 'rb').read()).hexdigest()].append(p)
lines = sorted(' '.join(sorted(v)) for v in g.values() if len(v) > 1)
open({out!r}, 'w').write('\\n'.join(lines) + '\\n')
EOF"""
        truth = "\n".join(sorted(groups))
        check = exact_text_check(out, truth)
        return self.in_workdir(w, prompt, solve, check, fixtures, [out], truth, inputs=[w])


@register
class ResourceReport(Family):
    name, domain, skill_type, primitive_skill = (
        "resource_report",
        "system_administration",
        "process_management",
        "resource_report",
    )
    command_complexity = "bash-only"

    def make(self, rng, sig):
        w = workdir(rng)
        procs = [
            (rng.randint(100, 9999), word(rng) + str(i), rng.randint(1000, 900000))
            for i in range(8 + 4 * COMPLEXITY_SCALE[sig.task_complexity])
        ]
        text = "PID COMMAND RSS_KB\n" + "".join(f"{p} {c} {r}\n" for p, c, r in procs)
        top = rng.randint(2, 4)
        best = sorted(procs, key=lambda t: (-t[2], t[0]))[:top]
        truth = "\n".join(f"{c} {r}" for _, c, r in best)
        out = f"{w}/top_memory.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/ps_snapshot.txt is a process snapshot (header line, then 'PID COMMAND RSS_KB'). Write
            {out} with the {top} processes using the most memory, one per line as '<COMMAND> <RSS_KB>',
            largest first (ties: lower PID first).""",
        )
        solve = f"tail -n +2 {w}/ps_snapshot.txt | sort -k3,3nr -k1,1n | head -n {top} | awk '{{print $2, $3}}' > {out}\n"
        check = exact_text_check(out, truth)
        return self.in_workdir(w, prompt, solve, check, {"ps_snapshot.txt": text}, [out], truth)


@register
class DateRewrite(Family):
    name, domain, skill_type, primitive_skill = (
        "date_rewrite",
        "text_processing",
        "transformation",
        "date_rewrite",
    )
    command_complexity = "bash-only"

    def make(self, rng, sig):
        w = workdir(rng)
        lines, want = [], []
        for _ in range(5 + 5 * COMPLEXITY_SCALE[sig.task_complexity]):
            d, m, y = rng.randint(1, 28), rng.randint(1, 12), rng.randint(1990, 2030)
            who = word(rng)
            lines.append(f"{who} signed on {d:02d}/{m:02d}/{y} (ref {rng.randint(10, 99)})")
            want.append(f"{who} signed on {y}-{m:02d}-{d:02d} (ref {lines[-1].split('ref ')[1]}")
        out = f"{w}/iso.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/records.txt has dates written DD/MM/YYYY. Write {out}: the same lines in the same order with
            every date rewritten as YYYY-MM-DD and nothing else changed.""",
        )
        solve = f"sed -E 's#([0-9]{{2}})/([0-9]{{2}})/([0-9]{{4}})#\\3-\\2-\\1#g' {w}/records.txt > {out}\n"
        truth = "\n".join(want)
        check = exact_text_check(out, truth)
        return self.in_workdir(
            w, prompt, solve, check, {"records.txt": "\n".join(lines) + "\n"}, [out], truth
        )


@register
class WordFrequency(Family):
    name, domain, skill_type, primitive_skill = (
        "word_frequency",
        "text_processing",
        "statistics",
        "word_frequency",
    )
    command_complexity = "bash-only"

    def make(self, rng, sig):
        w = workdir(rng)
        vocab = rng.sample(WORDS_FOR_TEXT, 12)
        tokens = [rng.choice(vocab) for _ in range(60 * COMPLEXITY_SCALE[sig.task_complexity])]
        text = " ".join(t.capitalize() if rng.random() < 0.3 else t for t in tokens)
        k = rng.randint(3, 6)
        counts = {}
        for t in tokens:
            counts[t] = counts.get(t, 0) + 1
        top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        truth = "\n".join(f"{c} {t}" for t, c in top)
        out = f"{w}/top_words.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            Count words in {w}/article.txt case-insensitively (words are separated by spaces). Write
            {out} with the {k} most frequent words as '<count> <word>' (word in lower case), most frequent
            first, ties broken alphabetically.""",
        )
        solve = f"tr ' ' '\\n' < {w}/article.txt | tr 'A-Z' 'a-z' | grep -v '^$' | sort | uniq -c | awk '{{print $1, $2}}' | sort -k1,1nr -k2,2 | head -n {k} > {out}\n"
        check = exact_text_check(out, truth)
        return self.in_workdir(w, prompt, solve, check, {"article.txt": text + "\n"}, [out], truth)


WORDS_FOR_TEXT = "river stone cloud signal market garden engine paper window bridge forest shadow letter metal silver planet number".split()


def _ocr(png: bytes) -> str:
    """What the reference solution's pipeline extracts from ``png`` (tesseract, spaces dropped)."""
    import re

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "b.png").write_bytes(png)
        r = subprocess.run(["tesseract", str(Path(tmp) / "b.png"), "stdout"], capture_output=True, text=True)
    m = re.search(r"[A-Z]{4}-[0-9]{4}", r.stdout.replace(" ", "").replace("\n", ""))
    return m.group(0) if m else ""


@register
class OcrCode(Family):
    name, domain, skill_type, primitive_skill = (
        "ocr_code",
        "text_processing",
        "extraction",
        "ocr_transcription",
    )
    fixture_kind = "image"
    command_complexity = "bash+code"

    def make(self, rng, sig):
        from PIL import Image, ImageDraw, ImageFont

        w = workdir(rng)
        font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSansMono-Bold.ttf", 64)
        # Keep only renderings that tesseract reads back exactly, so the task is solvable as stated.
        for _ in range(20):
            letters = "".join(rng.choice("ABCDEFGHJKLMNPRTUVWXY") for _ in range(4))
            code = letters + "-" + "".join(rng.choice("2345679") for _ in range(4))
            img = Image.new("L", (560, 140), 255)
            ImageDraw.Draw(img).text((30, 30), code, font=font, fill=0)
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            if _ocr(buf.getvalue()) == code:
                break
        else:
            raise RuntimeError("tesseract could not read back any rendered badge")
        out = f"{w}/code.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/badge.png is a scanned badge showing an access code (four letters, a dash, four digits).
            Write the code to {out} (just the code). tesseract is installed.""",
        )
        solve = f"tesseract {w}/badge.png stdout 2>/dev/null | tr -d ' \\n' | grep -oE '[A-Z]{{4}}-[0-9]{{4}}' | head -1 > {out}\n"
        check = exact_text_check(out, code)
        return self.in_workdir(w, prompt, solve, check, {"badge.png": buf.getvalue()}, [out], code)


@register
class AudioMetadata(Family):
    name, domain, skill_type, primitive_skill = (
        "audio_metadata",
        "text_processing",
        "extraction",
        "audio_metadata",
    )
    fixture_kind = "audio"
    command_complexity = "bash+code"

    def make(self, rng, sig):
        w = workdir(rng)
        fixtures, lines = {}, []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(1 + COMPLEXITY_SCALE[sig.task_complexity]):
                name = f"{word(rng)}{i}.wav"
                raw, final = Path(tmp) / f"r{i}.wav", Path(tmp) / name
                text = " ".join(rng.sample(WORDS_FOR_TEXT, rng.randint(2, 6)))
                subprocess.run(
                    ["espeak-ng", "-s", str(rng.randint(120, 220)), "-w", str(raw), text],
                    check=True,
                    capture_output=True,
                )
                subprocess.run(
                    ["sox", str(raw), "-r", str(rng.choice([8000, 16000, 22050])), str(final)],
                    check=True,
                    capture_output=True,
                )
                fixtures[name] = final.read_bytes()
                with wave.open(str(final)) as wf:
                    rate, frames = wf.getframerate(), wf.getnframes()
                lines.append(f"{name} {rate} {frames / rate:.2f}")
        # The report the fixtures call for, fixed now: graded against the agent's own dir, deleting
        # the .wav files made an empty report the right one.
        want = "\n".join(sorted(lines))
        out = f"{w}/audio_report.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            For every .wav file in {w} write a line '<file name> <sample rate in Hz> <duration in seconds
            with 2 decimals>' to {out}, sorted by file name. sox/soxi are installed.""",
        )
        solve = f'cd {w}\nfor f in $(ls *.wav | sort); do printf \'%s %s %.2f\\n\' "$f" "$(soxi -r "$f")" "$(soxi -D "$f")"; done > {out}\n'
        check = f"""
            from pathlib import Path
            def grade():
                p = Path({out!r})
                if not p.is_file():
                    return 0.0
                return exact_text(p.read_text(), {want!r})
            """
        return self.in_workdir(w, prompt, solve, check, fixtures, [out])


@register
class CsvGroupSum(Family):
    name, domain, skill_type, primitive_skill = "csv_group_sum", "data_science", "aggregation", "group_by"

    def make(self, rng, sig):
        w = workdir(rng)
        keys = rng.sample(WORDS, 3 + COMPLEXITY_SCALE[sig.task_complexity])
        col = rng.choice(["units", "amount", "hours"])
        rows = [
            (rng.choice(keys), rng.randint(1, 500)) for _ in range(20 * COMPLEXITY_SCALE[sig.task_complexity])
        ]
        buf = io.StringIO()
        wr = csv.writer(buf)
        wr.writerow(["id", "group", col])
        for i, (k, v) in enumerate(rows):
            wr.writerow([i, k, v])
        sums = {}
        for k, v in rows:
            sums[k] = sums.get(k, 0) + v
        truth = "\n".join(f"{k},{sums[k]}" for k in sorted(sums))
        out = f"{w}/totals.csv"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/data.csv has columns id,group,{col}. Write {out} with one line '<group>,<sum of {col}>'
            per group, sorted by group name, no header.""",
        )
        solve = f"tail -n +2 {w}/data.csv | awk -F, '{{s[$2] += $3}} END {{for (k in s) print k \",\" s[k]}}' | sort > {out}\n"
        check = exact_text_check(out, truth)
        return self.in_workdir(w, prompt, solve, check, {"data.csv": buf.getvalue()}, [out], truth)


@register
class RegressionPredict(Family):
    name, domain, skill_type, primitive_skill = (
        "regression_predict",
        "data_science",
        "modeling",
        "regression_fit",
    )
    verifier_kind = "metric_threshold"

    def make(self, rng, sig):
        w = workdir(rng)
        a, b, noise = rng.uniform(-5, 5), rng.uniform(-20, 20), rng.uniform(0.1, 1.0)
        xs = [rng.uniform(0, 100) for _ in range(40 * COMPLEXITY_SCALE[sig.task_complexity])]
        train = "x,y\n" + "".join(f"{x:.4f},{a * x + b + rng.gauss(0, noise):.4f}\n" for x in xs)
        tx = [rng.uniform(0, 100) for _ in range(20)]
        truth = [a * x + b for x in tx]
        out = f"{w}/predictions.txt"
        bound = 3 * noise
        # No credit for predicting the training mean (its RMSE is ~|a| * 29 here): partial credit
        # runs from the bound down to half of that constant predictor's error.
        mean_y = sum(a * x + b for x in xs) / len(xs)
        rmse_mean = math.sqrt(sum((mean_y - t) ** 2 for t in truth) / len(truth))
        worst = max(2 * bound, 0.5 * rmse_mean)
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/train.csv holds (x, y) samples of a noisy linear relation. Predict y for every x in
            {w}/test.txt (one x per line) and write the predictions, one per line in the same order, to
            {out}. The root-mean-square error against the true relation must be below {bound:.3f}.""",
        )
        solve = f"""python3 - <<'EOF'
rows = [tuple(map(float, l.split(','))) for l in open('{w}/train.csv').read().split()[1:]]
n = len(rows); mx = sum(r[0] for r in rows) / n; my = sum(r[1] for r in rows) / n
a = sum((x - mx) * (y - my) for x, y in rows) / sum((x - mx) ** 2 for x, _ in rows); b = my - a * mx
xs = [float(l) for l in open('{w}/test.txt').read().split()]
open('{out}', 'w').write(''.join(f'{{a * x + b}}\\n' for x in xs))
EOF"""
        check = f"""
            import math
            from pathlib import Path
            def grade():
                p = Path({out!r})
                if not p.is_file():
                    return 0.0
                try:
                    pred = [float(v) for v in p.read_text().split()]
                except ValueError:
                    return 0.0
                truth = {truth!r}
                if len(pred) != len(truth):
                    return 0.0
                rmse = math.sqrt(sum((u - v) ** 2 for u, v in zip(pred, truth)) / len(truth))
                return metric_threshold(rmse, {bound!r}, {worst!r}, higher_is_better=False)
            """
        fixtures = {"train.csv": train, "test.txt": "".join(f"{x:.4f}\n" for x in tx)}
        return self.in_workdir(w, prompt, solve, check, fixtures, [out], inputs=[f"{w}/train.csv"])


@register
class SqliteReport(Family):
    name, domain, skill_type, primitive_skill = "sqlite_report", "data_science", "aggregation", "pivot"

    def make(self, rng, sig):
        w = workdir(rng)
        customers = rng.sample(WORDS, 4 + COMPLEXITY_SCALE[sig.task_complexity])
        orders = [
            (i, rng.choice(customers), rng.randint(5, 400))
            for i in range(30 * COMPLEXITY_SCALE[sig.task_complexity])
        ]
        threshold = rng.randint(300, 1500)
        with tempfile.TemporaryDirectory() as tmp:
            db = Path(tmp) / "shop.db"
            con = sqlite3.connect(db)
            con.execute("create table orders (id integer primary key, customer text, total integer)")
            con.executemany("insert into orders values (?, ?, ?)", orders)
            con.commit()
            con.close()
            blob = db.read_bytes()
        sums = {}
        for _, c, t in orders:
            sums[c] = sums.get(c, 0) + t
        truth = "\n".join(
            f"{c}|{s}" for c, s in sorted(sums.items(), key=lambda kv: (-kv[1], kv[0])) if s > threshold
        )
        out = f"{w}/big_customers.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/shop.db is a SQLite database with a table orders(id, customer, total). Write {out} with
            every customer whose summed totals exceed {threshold}, one per line as '<customer>|<sum>',
            largest sum first (ties by name).""",
        )
        solve = f"""python3 - <<'EOF'
import sqlite3
con = sqlite3.connect('{w}/shop.db')
rows = con.execute('select customer, sum(total) s from orders group by customer having s > {threshold} order by s desc, customer').fetchall()
open('{out}', 'w').write(''.join(f'{{c}}|{{s}}\\n' for c, s in rows))
EOF"""
        check = exact_text_check(out, truth)
        return self.in_workdir(w, prompt, solve, check, {"shop.db": blob}, [out], truth)
