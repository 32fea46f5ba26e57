"""Families: networking, devops, scientific computing."""

from __future__ import annotations

import ipaddress
import math
import textwrap

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

# Grader source shared by the numeric families: partial credit on a log scale of the error, so that
# an answer 10x off the bound keeps half the credit or more, a wrong formula or a guess ~none.
# 95% of the credit runs out at ``near`` (a right method short on accuracy: too few steps, too few
# digits written); the last 5% at ``far`` (the ballpark), so that a coarse answer is not flat zero.
_LOG_CREDIT = """
import math
def log_credit(err, bound, near, far=10.0):
    err = float(err)
    if math.isnan(err):
        return 0.0
    if err <= bound:
        return 1.0
    lg, lb = math.log10(err), math.log10(bound)
    fine = metric_threshold(lg, lb, math.log10(near), higher_is_better=False)
    coarse = metric_threshold(lg, lb, math.log10(far), higher_is_better=False)
    return 0.95 * fine + 0.05 * coarse
"""


@register
class CidrMembership(Family):
    name, domain, skill_type, primitive_skill = (
        "cidr_membership",
        "networking",
        "addressing",
        "cidr_membership",
    )

    def make(self, rng, sig):
        w = workdir(rng)
        prefix = rng.choice([16, 20, 22, 24, 26])
        net = ipaddress.ip_network(f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.0/{prefix}", strict=False)
        inside = [
            str(net.network_address + rng.randint(1, net.num_addresses - 2))
            for _ in range(3 + COMPLEXITY_SCALE[sig.task_complexity])
        ]
        outside = [f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}" for _ in range(6)]
        ips = sorted(set(inside + outside))
        rng.shuffle(ips)  # from a sorted list: the same order whatever the hash seed
        truth = "\n".join(
            sorted((ip for ip in ips if ipaddress.ip_address(ip) in net), key=ipaddress.ip_address)
        )
        out = f"{w}/in_subnet.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/hosts.txt lists IPv4 addresses, one per line. Write {out} with the addresses that belong
            to {net}, in ascending numeric order.""",
        )
        solve = f"python3 -c \"import ipaddress as i; n=i.ip_network('{net}'); ips=[i.ip_address(l) for l in open('{w}/hosts.txt').read().split()]; open('{out}','w').write(''.join(str(a)+chr(10) for a in sorted(x for x in ips if x in n)))\"\n"
        return self.in_workdir(
            w, prompt, solve, exact_text_check(out, truth), {"hosts.txt": "\n".join(ips) + "\n"}, [out], truth
        )


@register
class LatencyReport(Family):
    name, domain, skill_type, primitive_skill = (
        "latency_report",
        "networking",
        "diagnostics",
        "latency_report",
    )
    command_complexity = "bash-only"

    def make(self, rng, sig):
        w = workdir(rng)
        hosts = [f"{word(rng)}.example.net" for _ in range(2 + COMPLEXITY_SCALE[sig.task_complexity])]
        lines, samples = [], {h: [] for h in hosts}
        for _ in range(30):
            h = rng.choice(hosts)
            t = round(rng.uniform(0.3, 250), 1)
            samples[h].append(t)
            lines.append(f"64 bytes from {h}: icmp_seq={len(samples[h])} ttl=57 time={t} ms")
        truth = "\n".join(f"{h} {sum(v) / len(v):.1f}" for h, v in sorted(samples.items()) if v)
        out = f"{w}/latency.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/ping.log holds ping replies from several hosts. Write {out} with '<host> <mean time in ms,
            1 decimal>' for every host that replied, sorted by host name.""",
        )
        solve = f'grep -oE \'from [^:]+: .*time=[0-9.]+\' {w}/ping.log | awk \'{{h=$2; sub(":","",h); split($NF,a,"="); s[h]+=a[2]; n[h]++}} END {{for (h in s) printf "%s %.1f\\n", h, s[h]/n[h]}}\' | sort > {out}\n'
        return self.in_workdir(
            w,
            prompt,
            solve,
            exact_text_check(out, truth),
            {"ping.log": "\n".join(lines) + "\n"},
            [out],
            truth,
        )


@register
class HttpAndTcpService(Family):
    name, domain, skill_type, primitive_skill = "http_tcp_service", "networking", "services", "tcp_protocol"
    verifier_kind = "multi_protocol"
    fixture_kind = "multi_service_compose"  # two services, two protocols, one sandbox
    command_complexity = "bash+code+services"

    def make(self, rng, sig):
        w = workdir(rng)
        name = ident(rng)
        p1, p2 = rng.randint(8000, 8999), rng.randint(9000, 9999)
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            Start a service that keeps running after you finish: HTTP on 127.0.0.1:{p1} answering GET
            /health with the JSON {{"status": "ok", "name": "{name}"}}, and a line protocol on TCP
            127.0.0.1:{p2} where a client sending 'PING <word>' gets back 'PONG <word> {name}' (one line each).""",
        )
        server = textwrap.dedent(f"""
            import json, socketserver, threading
            from http.server import BaseHTTPRequestHandler, HTTPServer
            class H(BaseHTTPRequestHandler):
                def do_GET(self):
                    body = json.dumps({{"status": "ok", "name": "{name}"}}).encode()
                    self.send_response(200 if self.path == "/health" else 404)
                    self.send_header("Content-Type", "application/json"); self.end_headers(); self.wfile.write(body)
                def log_message(self, *a): pass
            class T(socketserver.StreamRequestHandler):
                def handle(self):
                    for line in self.rfile:
                        parts = line.decode().split()
                        if len(parts) == 2 and parts[0] == "PING":
                            self.wfile.write(f"PONG {{parts[1]}} {name}\\n".encode())
            socketserver.ThreadingTCPServer.allow_reuse_address = True
            threading.Thread(target=socketserver.ThreadingTCPServer(("127.0.0.1", {p2}), T).serve_forever, daemon=True).start()
            HTTPServer(("127.0.0.1", {p1}), H).serve_forever()
            """)
        # A double fork: the server is no child of the agent's shell, so it outlives it.
        solve = (
            f"mkdir -p {w}\ncat > {w}/server.py <<'PYEOF'\n{server}\nPYEOF\n"
            f"( setsid python3 {w}/server.py >/dev/null 2>&1 & )\n"
            f'python3 -c "\nimport socket, time\nfor _ in range(100):\n    try:\n'
            f"        socket.create_connection(('127.0.0.1', {p1}), 1).close(); socket.create_connection(('127.0.0.1', {p2}), 1).close(); break\n"
            f'    except OSError:\n        time.sleep(0.1)\n"\n'
        )
        token = word(rng)
        check = f"""
            import json, socket, urllib.request
            def _http():
                with urllib.request.urlopen('http://127.0.0.1:{p1}/health', timeout=5) as r:
                    return json.loads(r.read()) == {{"status": "ok", "name": {name!r}}}
            def _tcp():
                with socket.create_connection(('127.0.0.1', {p2}), timeout=5) as s:
                    s.sendall(b'PING {token}\\n')
                    return s.makefile().readline().strip() == 'PONG {token} {name}'
            def grade():
                return multi_protocol({{'http': _http, 'tcp': _tcp}})
            """
        draft = TaskDraft(
            self.name, prompt, solve, check, files_exist_test([], [f"{w}/server.py"]), f"mkdir -p {w}\n", {}
        )
        draft.params = {"http_port": p1, "tcp_port": p2, "name": name}
        draft.limits = {"agent_services": True}  # the tests talk to the agent's service
        return draft


@register
class IniEdit(Family):
    name, domain, skill_type, primitive_skill = "ini_edit", "devops", "configuration", "ini_edit"
    command_complexity = "bash-only"

    def make(self, rng, sig):
        w = workdir(rng)
        port, new_port, timeout = rng.randint(1024, 5000), rng.randint(5001, 9999), rng.randint(5, 120)
        sections = {
            "server": {"host": "0.0.0.0", "port": str(port)},
            word(rng): {"level": rng.choice(["info", "debug"])},
            "db": {"url": f"postgres://{word(rng)}/app"},
        }
        text = "".join(
            f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items()) + "\n" for s, kv in sections.items()
        )
        cfg = f"{w}/app.ini"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            In {cfg} change the [server] port to {new_port} and add 'timeout = {timeout}' to the [server]
            section. Leave every other setting as it is.""",
        )
        solve = (
            f"python3 - <<'PYEOF'\nimport configparser\nc = configparser.ConfigParser()\nc.read('{cfg}')\n"
            f"c['server']['port'] = '{new_port}'\nc['server']['timeout'] = '{timeout}'\n"
            f"with open('{cfg}', 'w') as f:\n    c.write(f)\nPYEOF\n"
        )
        others = {s: kv for s, kv in sections.items() if s != "server"}
        check = f"""
            import configparser
            def grade():
                c = configparser.ConfigParser()
                try:
                    c.read({cfg!r})
                    s = c['server']
                except Exception:
                    return 0.0
                # Both requested edits or nothing (the untouched file meets every preservation
                # check); then credit for what was kept as it was.
                if s.get('port') != '{new_port}' or s.get('timeout') != '{timeout}':
                    return 0.0
                kept = [s.get('host') == '0.0.0.0', set(s) == {{'host', 'port', 'timeout'}}]
                kept += [c.has_section(k) and dict(c[k]) == v for k, v in {others!r}.items()]
                kept.append(set(c.sections()) == {{'server', *{others!r}}})
                return 1.0 if all(kept) else 0.99 * sum(kept) / len(kept)
            """
        init = (
            files_exist_test([cfg])
            + f"\n\ndef test_old_port():\n    assert 'port = {port}' in open({cfg!r}).read()\n"
        )
        return TaskDraft(self.name, prompt, solve, check, init, copy_fixtures_setup(w), {"app.ini": text})


@register
class CompressionRatio(Family):
    name, domain, skill_type, primitive_skill = "compression_ratio", "devops", "automation", "compression"
    verifier_kind = "metric_threshold"
    command_complexity = "bash-only"

    def make(self, rng, sig):
        import hashlib
        import lzma

        w = workdir(rng)
        lines = [
            f"{rng.choice(['GET', 'POST'])} /api/{word(rng)}/{rng.randint(1, 50)} 200 {rng.randint(1, 900)}ms"
            for _ in range(3000 * COMPLEXITY_SCALE[sig.task_complexity])
        ]
        text = "\n".join(lines) + "\n"
        size, sha = len(text.encode()), hashlib.sha256(text.encode()).hexdigest()
        best = len(text.encode()) / len(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))
        bound = round(best * 0.9, 2)
        out = f"{w}/access.log.xz"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            Archive {w}/access.log as {out} (xz format) with a compression ratio (original size / archive
            size) of at least {bound}. Keep the original file.""",
        )
        solve = f"xz -9e -k -c {w}/access.log > {out}\n"
        check = f"""
            import hashlib, lzma
            from pathlib import Path
            SIZE, SHA = {size!r}, {sha!r}  # the original log, fixed at generation
            def grade():
                p, src = Path({out!r}), Path({w + "/access.log"!r})
                if not p.is_file() or not src.is_file():
                    return 0.0
                # The archive must hold the original log (not whatever access.log is now: an agent
                # can overwrite it with something that compresses well), and the original kept.
                if hashlib.sha256(src.read_bytes()).hexdigest() != SHA:
                    return 0.0
                d = lzma.LZMADecompressor()
                try:
                    data = d.decompress(p.read_bytes(), max_length=SIZE + 1)
                except lzma.LZMAError:
                    return 0.0
                if not d.eof or len(data) != SIZE or hashlib.sha256(data).hexdigest() != SHA:
                    return 0.0
                return metric_threshold(SIZE / p.stat().st_size, {bound!r}, 1.0)
            """
        return self.in_workdir(w, prompt, solve, check, {"access.log": text}, [out])


@register
class EnvTemplate(Family):
    name, domain, skill_type, primitive_skill = "env_template", "devops", "configuration", "env_templating"

    def make(self, rng, sig):
        w = workdir(rng)
        keys = [
            f"{word(rng).upper()}_{k}"
            for k in rng.sample(
                ["HOST", "PORT", "USER", "REGION", "TIER", "POOL"], 2 + COMPLEXITY_SCALE[sig.task_complexity]
            )
        ]
        vals = {k: f"{word(rng)}{rng.randint(1, 99)}" for k in keys}
        tmpl = "".join(f"{k.lower()}: ${{{k}}}\n" for k in keys) + "static: keep-$$literal\n"
        env = "".join(f"{k}={v}\n" for k, v in vals.items())
        truth = "".join(f"{k.lower()}: {vals[k]}\n" for k in keys) + "static: keep-$literal"
        out = f"{w}/rendered.yaml"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            Render {w}/config.tmpl into {out}: replace every ${{NAME}} with the value of NAME from
            {w}/deploy.env (KEY=value lines) and every '$$' with a single '$'.""",
        )
        solve = (
            f"python3 - <<'PYEOF'\nimport re\nenv = dict(l.split('=', 1) for l in open('{w}/deploy.env').read().split())\n"
            f"t = open('{w}/config.tmpl').read()\n"
            "t = re.sub(r'\\$\\{(\\w+)\\}', lambda m: env[m.group(1)], t).replace('$$', '$')\n"
            f"open('{out}', 'w').write(t)\nPYEOF\n"
        )
        return self.in_workdir(
            w,
            prompt,
            solve,
            exact_text_check(out, truth),
            {"config.tmpl": tmpl, "deploy.env": env},
            [out],
            truth,
            inputs=[f"{w}/config.tmpl"],
        )


@register
class MakefileFix(Family):
    name, domain, skill_type, primitive_skill = "makefile_fix", "devops", "build_systems", "makefile_fix"

    def make(self, rng, sig):
        w = workdir(rng)
        mods = rng.sample(WORDS, 2 + COMPLEXITY_SCALE[sig.task_complexity] // 2)
        # Each module prints a value that app computes at run time, chained through every module from
        # a seed in main.c with constants of its own: no source holds any printed value, so an 'app'
        # that echoes names or numbers found in the sources cannot pass; linking all of them does.
        x, truth_lines, files = rng.getrandbits(32), [], {}
        files["main.c"] = (
            "".join(f"unsigned {m}(unsigned x);\n" for m in mods)
            + f"int main(void) {{\n  unsigned x = {x}u;\n"
            + "".join(f"  x = {m}(x);\n" for m in mods)
            + "  return 0;\n}\n"
        )
        for m in mods:
            mul, add, sh = rng.getrandbits(32) | 1, rng.getrandbits(32), rng.randint(7, 19)
            files[f"{m}.c"] = (
                f"#include <stdio.h>\nunsigned {m}(unsigned x) {{\n  x = x * {mul}u + {add}u;\n"
                f'  x ^= x >> {sh};\n  printf("{m} %u\\n", x);\n  return x;\n}}\n'
            )
            x = (x * mul + add) & 0xFFFFFFFF
            x ^= x >> sh
            truth_lines.append(f"{m} {x}")
        objs = " ".join(f"{m}.o" for m in mods[:-1])  # the bug: the last module is never linked
        files["Makefile"] = (
            f"app: main.o {objs}\n\tcc -o app main.o {objs}\n\n%.o: %.c\n\tcc -c $< -o $@\n\nclean:\n\trm -f *.o app\n"
        )
        truth = "\n".join(truth_lines)
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            'make' in {w} fails to link 'app'. Fix the Makefile so that 'make clean && make' builds {w}/app
            from all the .c files there. Do not edit the .c files.""",
        )
        all_objs = " ".join(f"{m}.o" for m in mods)
        solve = f"cd {w}\nsed -i 's/^app: .*/app: main.o {all_objs}/; s/^\\tcc -o app .*/\\tcc -o app main.o {all_objs}/' Makefile\nmake clean >/dev/null && make >/dev/null\n"
        check = f"""
            def grade():
                # od prints app's first 4 bytes before app runs: app must be a compiled (ELF)
                # program, not a script that prints what it was told to.
                r = run_untrusted(
                    'make clean >/dev/null 2>&1; make >/dev/null 2>&1 && od -An -tx1 -N4 app && ./app', {w!r}
                )
                lines = r.stdout.splitlines()
                if r.returncode != 0 or not lines or lines[0].split() != ['7f', '45', '4c', '46']:
                    return 0.0
                return exact_text(chr(10).join(lines[1:]), {truth!r})
            """
        return self.in_workdir(w, prompt, solve, check, files, [f"{w}/app"], truth, inputs=[f"{w}/Makefile"])


@register
class Quadrature(Family):
    name, domain, skill_type, primitive_skill = "quadrature", "scientific_computing", "numerics", "quadrature"
    verifier_kind = "metric_threshold"

    def make(self, rng, sig):
        w = workdir(rng)
        while True:  # the sin term at least 2% of the integral: dropping it is no near miss
            a, b, c, L = rng.randint(1, 9), rng.randint(1, 5), rng.randint(1, 4), rng.randint(2, 9)
            exact = a * (1 - math.cos(b * L)) / b + c * L**3 / 3
            if a * (1 - math.cos(b * L)) / b >= 0.02 * exact:
                break
        out = f"{w}/integral.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            Compute the integral of f(x) = {a}*sin({b}*x) + {c}*x**2 over [0, {L}] and write the number to
            {out}. A relative error below 1e-6 is required.""",
        )
        solve = f"python3 -c \"import math; n=20000; h={L}/n; f=lambda x: {a}*math.sin({b}*x)+{c}*x*x; s=f(0)+f({L})+sum((4 if i%2 else 2)*f(i*h) for i in range(1,n)); open('{out}','w').write(repr(s*h/3))\"\n"
        check = _LOG_CREDIT + textwrap.dedent(f"""
            from pathlib import Path
            def grade():
                p = Path({out!r})
                if not p.is_file():
                    return 0.0
                try:
                    v = float(p.read_text().strip())
                except ValueError:
                    return 0.0
                return log_credit(abs(v - {exact!r}) / abs({exact!r}), 1e-6, 1e-3)
            """)
        draft = TaskDraft(self.name, prompt, solve, check, files_exist_test([], [out]), f"mkdir -p {w}\n", {})
        draft.params = {"output": out, "exact": exact}
        return draft


@register
class OdeDecay(Family):
    name, domain, skill_type, primitive_skill = (
        "ode_decay",
        "scientific_computing",
        "simulation",
        "ode_integration",
    )
    verifier_kind = "metric_threshold"

    def make(self, rng, sig):
        w = workdir(rng)
        while True:  # neither the equilibrium s/k nor y0 is within 0.05 of y(T): both need the ODE
            k, s, y0, T = (
                round(rng.uniform(0.1, 2), 3),
                round(rng.uniform(0, 5), 3),
                round(rng.uniform(1, 10), 3),
                rng.randint(1, 10),
            )
            exact = s / k + (y0 - s / k) * math.exp(-k * T)
            if min(abs(exact - s / k), abs(exact - y0)) >= 0.05:
                break
        out = f"{w}/y_at_T.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            Integrate dy/dt = -{k}*y + {s} with y(0) = {y0} up to t = {T} and write y({T}) to {out}
            (absolute error below 1e-5).""",
        )
        solve = (
            f'python3 -c "\nk,s,y,T={k},{s},{y0},{T}\nn=4000;h=T/n\nf=lambda y:-k*y+s\n'
            f"for _ in range(n):\n  a=f(y);b=f(y+h*a/2);c=f(y+h*b/2);d=f(y+h*c);y+=h*(a+2*b+2*c+d)/6\n"
            f"open('{out}','w').write(repr(y))\"\n"
        )
        check = _LOG_CREDIT + textwrap.dedent(f"""
            from pathlib import Path
            def grade():
                p = Path({out!r})
                if not p.is_file():
                    return 0.0
                try:
                    v = float(p.read_text().strip())
                except ValueError:
                    return 0.0
                return log_credit(abs(v - {exact!r}), 1e-5, 1e-2)
            """)
        draft = TaskDraft(self.name, prompt, solve, check, files_exist_test([], [out]), f"mkdir -p {w}\n", {})
        draft.params = {"output": out, "exact": exact}
        return draft


@register
class SignalStats(Family):
    name, domain, skill_type, primitive_skill = (
        "signal_stats",
        "scientific_computing",
        "data_reduction",
        "signal_stats",
    )
    verifier_kind = "metric_threshold"

    def make(self, rng, sig):
        w = workdir(rng)
        mu, sd = rng.uniform(-10, 10), rng.uniform(0.5, 5)
        xs = [rng.gauss(mu, sd) for _ in range(500 * COMPLEXITY_SCALE[sig.task_complexity])]
        m = sum(xs) / len(xs)
        std = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
        out = f"{w}/stats.txt"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/signal.txt has one sample per line. Write '<mean> <sample standard deviation>' (n-1 in the
            denominator) on one line to {out}.""",
        )
        solve = f"python3 -c \"import statistics as s; x=[float(v) for v in open('{w}/signal.txt').read().split()]; open('{out}','w').write(f'{{s.fmean(x)}} {{s.stdev(x)}}')\"\n"
        # 95% of the credit ends 100x past the bound: the population std (n in the denominator) is off
        # by about 1/(2n) >= 2.5e-4 relative, and a subset of the samples by far more.
        check = _LOG_CREDIT + textwrap.dedent(f"""
            from pathlib import Path
            def grade():
                p = Path({out!r})
                try:
                    m, s = (float(v) for v in p.read_text().split())
                except Exception:
                    return 0.0
                err = max(abs(m - {m!r}), abs(s - {std!r})) / {std!r}
                return log_credit(err, 1e-6, 1e-4)
            """)
        return self.in_workdir(
            w, prompt, solve, check, {"signal.txt": "".join(f"{x!r}\n" for x in xs)}, [out]
        )


@register
class UnitConversion(Family):
    name, domain, skill_type, primitive_skill = (
        "unit_conversion",
        "scientific_computing",
        "data_reduction",
        "unit_conversion",
    )
    command_complexity = "bash-only"

    def make(self, rng, sig):
        w = workdir(rng)
        temps = [round(rng.uniform(-40, 220), 1) for _ in range(8 * COMPLEXITY_SCALE[sig.task_complexity])]
        stations = [f"{word(rng)}{i}" for i in range(len(temps))]
        truth = "\n".join(f"{s},{(t - 32) * 5 / 9:.2f}" for s, t in zip(stations, temps))
        out = f"{w}/celsius.csv"
        prompt = persona_prompt(
            rng,
            sig.persona,
            f"""
            {w}/fahrenheit.csv has 'station,temp_f' lines (no header). Write {out} with 'station,temp_c'
            lines in the same order, Celsius with exactly 2 decimals.""",
        )
        solve = f"python3 -c \"import sys; rows=[l.split(',') for l in open('{w}/fahrenheit.csv').read().split()]; open('{out}','w').write(''.join(f'{{s}},{{(float(t) - 32) * 5 / 9:.2f}}' + chr(10) for s, t in rows))\"\n"
        fixtures = {"fahrenheit.csv": "".join(f"{s},{t}\n" for s, t in zip(stations, temps))}
        draft = self.in_workdir(
            w,
            prompt,
            solve,
            exact_text_check(out, truth),
            fixtures,
            [out],
            truth,
            inputs=[f"{w}/fahrenheit.csv"],
        )
        draft.params = {"output": out}
        return draft
