"""Matrix-unit work of a compiled XLA program, from its HLO text (``tmax-jax plan --compile --dump-hlo``).

    python benchmarks/hlo_report.py DIR/train_step.hlo.txt [--model-flops F --devices N] [--json]

Reads the optimized HLO of one device's program (SPMD: shapes are per device) and reports

- the matmul work, trip-count weighted: every ``dot`` and every ``convolution`` (XLA:TPU rewrites
  dots as convolutions) counts ``2 * multiply-adds`` times the number of times its computation runs.
  A while loop's body runs its trip count times: ``known_trip_count`` from the loop's backend config,
  else the bound of its condition (``i < N`` on a counter that starts at a constant, 0 if unknown).
  Fusions, calls and conditional branches run as often as the instruction that calls them (every
  branch counted: an upper bound);
- MXU passes per dot: bfloat16 operands one; float32 operands by their precision
  (``operand_precision={highest,...}`` 6, ``high`` 3, default 1; an ``algorithm=`` like
  ``dot_bf16_bf16_f32_x6`` says its pass count itself), and the pass-weighted work;
- every float32 dot with its source line (HLO metadata: ``source_file``/``source_line``, or the
  module's ``StackFrames`` table), its precision and its weighted work;
- Pallas (Mosaic) kernels: ``tpu_custom_call`` custom calls, trip-count weighted (their own matmuls
  are inside the kernel, not counted above);
- with ``--model-flops``: the model's FLOPs per device over the program's matmul FLOPs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

PASSES = {"highest": 6, "high": 3, "default": 1}
_ARRAY = re.compile(r"^([a-z]+[0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?[\w.\-]+\s+\(.*\)\s+->\s+.*\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # the result type as printed
    opcode: str
    operands: list[str]  # operand names (without %)
    operand_types: list[str | None]  # a type printed beside the operand, when the dump has one
    attrs: str  # everything after the operand list
    computation: str


@dataclasses.dataclass
class Dot:
    name: str
    opcode: str
    dtype: str  # operand element type (lhs)
    precision: str  # highest / high / default, or the algorithm name
    passes: int
    macs: int  # multiply-adds of one execution
    runs: int  # executions per program run
    source: str

    @property
    def flops(self) -> int:
        return 2 * self.macs * self.runs

    @property
    def mxu_flops(self) -> int:
        return self.flops * self.passes


def _split_top(s: str, sep: str = ",") -> list[str]:
    """``s`` split at ``sep`` outside brackets."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return [x.strip() for x in out if x.strip()]


def _matching(s: str, i: int) -> int:
    """Index of the bracket closing the one at ``s[i]``."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "([{":
            depth += 1
        elif s[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return len(s) - 1


def parse_instruction(line: str, computation: str) -> Instr | None:
    s = _COMMENT.sub("", line).strip()
    if s.startswith("ROOT "):
        s = s[5:]
    if " = " not in s:
        return None
    name, rest = s.split(" = ", 1)
    name = name.strip().lstrip("%")
    if rest.startswith("("):
        end = _matching(rest, 0)
        typ, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        typ, _, rest = rest.partition(" ")
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return None
    opcode = m.group(1)
    end = _matching(rest, m.end() - 1)
    names, types = [], []
    for op in _split_top(rest[m.end() : end]):
        parts = op.rsplit(" ", 1)
        if len(parts) == 2 and parts[1].startswith("%"):
            types.append(parts[0])
            names.append(parts[1].lstrip("%"))
        else:
            types.append(None)
            names.append(op.lstrip("%"))
    return Instr(name, typ, opcode, names, types, rest[end + 1 :], computation)


def parse_module(text: str):
    """(computations: name -> [Instr], entry name, instruction by name, source table)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    tables: dict[str, dict[int, str]] = defaultdict(dict)
    table = None
    for line in text.splitlines():
        if not line.strip():
            continue
        # A computation's header (not a continuation line of a multi-line backend config).
        if line[0] not in " \t}" and _HEADER.match(line):
            header = line.strip()
            is_entry = header.startswith("ENTRY ")
            header = header[6:] if is_entry else header
            current = header.split(" ", 1)[0].lstrip("%")
            comps[current] = []
            if is_entry:
                entry = current
            table = None
            continue
        if line.rstrip() == "}":
            current = None
            continue
        if current is None:
            word = line.strip()
            if word in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                table = word
                continue
            if table is not None:
                key, _, value = word.partition(" ")
                if key.isdigit():
                    tables[table][int(key)] = value
            continue
        ins = parse_instruction(line, current)
        if ins is not None:
            comps[current].append(ins)
    by_name = {i.name: i for c in comps.values() for i in c}
    return comps, entry, by_name, tables


def _array(typ: str | None) -> tuple[str, list[int]] | None:
    if not typ:
        return None
    m = _ARRAY.match(typ)
    if not m:
        return None
    dims = [int(d) for d in m.group(2).split(",") if d]
    return m.group(1), dims


def _operand(ins: Instr, k: int, by_name: dict) -> tuple[str, list[int]] | None:
    if k < len(ins.operand_types) and ins.operand_types[k]:
        return _array(ins.operand_types[k])
    src = by_name.get(ins.operands[k]) if k < len(ins.operands) else None
    return _array(src.type) if src is not None else None


def _ints(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _constant(ins: Instr | None) -> int | None:
    if ins is None or ins.opcode != "constant" or not ins.operands:
        return None
    m = re.match(r"(-?\d+)$", ins.operands[0])
    return int(m.group(1)) if m else None


def trip_count(ins: Instr, comps: dict, by_name: dict) -> int | None:
    """A while loop's trip count: its known_trip_count, else ``N - start`` from the condition
    ``i < N``, where ``N`` is a constant or a loop-carried value the loop starts with as a constant,
    and ``i`` a counter that starts at a constant (0 when it cannot be told)."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.attrs)
    if m:
        return int(m.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", ins.attrs)
    body = comps.get(cond.group(1), []) if cond else []
    local = {i.name: i for i in body}
    init = by_name.get(ins.operands[0]) if ins.operands else None

    def carried(gte: Instr) -> int | None:
        index = re.search(r"index=(\d+)", gte.attrs)
        if init is None or init.opcode != "tuple" or not index or int(index.group(1)) >= len(init.operands):
            return None
        return _constant(by_name.get(init.operands[int(index.group(1))]))

    for i in body:
        if i.opcode != "compare" or "direction=LT" not in i.attrs or len(i.operands) != 2:
            continue
        a, b = (local.get(n) for n in i.operands)
        if a is None or b is None or a.opcode != "get-tuple-element":
            continue
        bound = (
            _constant(b)
            if b.opcode == "constant"
            else carried(b)
            if b.opcode == "get-tuple-element"
            else None
        )
        if bound is None:
            continue
        start = carried(a)
        return max(bound - (start or 0), 0)
    return None


def executions(
    comps: dict, entry: str, by_name: dict, unknown_trips: int = 1
) -> tuple[dict[str, int], list[str]]:
    """How many times each computation runs per program run; loops whose trip count is unknown
    (data-dependent: counted ``unknown_trips`` times)."""
    runs: dict[str, int] = defaultdict(int)
    unknown: list[str] = []

    def walk(comp: str, m: int, depth: int = 0) -> None:
        if depth > 64 or comp not in comps:
            return
        runs[comp] += m
        for ins in comps[comp]:
            if ins.opcode == "while":
                body = re.search(r"\bbody=%?([\w.\-]+)", ins.attrs)
                n = trip_count(ins, comps, by_name)
                if n is None:
                    unknown.append(ins.name)
                    n = unknown_trips
                if body:
                    walk(body.group(1), m * n, depth + 1)
                continue
            callees = [c for c in _CALLS.findall(ins.attrs)]
            for group in _BRANCHES.findall(ins.attrs):
                callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
            for c in callees:
                if ins.opcode in ("reduce", "reduce-window", "scatter", "sort", "select-and-scatter", "map"):
                    continue  # scalar reducers: no matmuls
                walk(c, m, depth + 1)

    walk(entry, 1)
    return runs, unknown


def _precision(attrs: str) -> tuple[str, int]:
    alg = re.search(r"\balgorithm=([\w]+)", attrs)
    if alg:
        x = re.search(r"_x(\d+)$", alg.group(1))
        return alg.group(1), int(x.group(1)) if x else 1
    m = re.search(r"operand_precision=\{([^}]*)\}", attrs)
    if m:
        levels = [p.strip().lower() for p in m.group(1).split(",")]
        level = max(levels, key=lambda p: PASSES.get(p, 1))
        return level, PASSES.get(level, 1)
    return "default", 1


def _macs(ins: Instr, by_name: dict) -> int | None:
    out = _array(ins.type)
    if out is None:
        return None
    lhs, rhs = _operand(ins, 0, by_name), _operand(ins, 1, by_name)
    if ins.opcode == "dot":
        if lhs is None:
            return None
        k = math.prod(lhs[1][d] for d in _ints(ins.attrs, "lhs_contracting_dims"))
        return math.prod(out[1]) * k
    # convolution: (output rows x output features) x (rhs input features) x, per spatial dim, the
    # window taps that land on real input summed over output positions. XLA:TPU writes dots as
    # convolutions whose windows mostly cover padding or the holes of a dilated input; those taps
    # multiply zeros and are not work.
    if rhs is None or lhs is None:
        return None
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not labels:
        return None
    lhs_l, rhs_l, out_l = labels.groups()
    spatial = sorted(c for c in out_l if c.isdigit())
    n = len(spatial)
    fields = {}
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    if window:
        fields = dict(f.split("=", 1) for f in window.group(1).split() if "=" in f)

    def per_dim(key, default):
        v = fields.get(key)
        return [default] * n if v is None else v.split("x")

    size = [int(x) for x in per_dim("size", "1")]
    stride = [int(x) for x in per_dim("stride", "1")]
    lhs_dil = [int(x) for x in per_dim("lhs_dilate", "1")]
    rhs_dil = [int(x) for x in per_dim("rhs_dilate", "1")]
    pad_lo = [int(x.split("_")[0]) for x in per_dim("pad", "0_0")]
    taps = 1
    for d in spatial:
        j = int(d)
        t_in = lhs[1][lhs_l.index(d)]
        t_out = out[1][out_l.index(d)]
        p = np.arange(t_out)[:, None] * stride[j]
        k = np.arange(size[j])[None, :] * rhs_dil[j]
        q = p + k - pad_lo[j]
        real = (q >= 0) & (q % lhs_dil[j] == 0) & (q // lhs_dil[j] < t_in)
        taps *= int(real.sum())
    rows = out[1][out_l.index("b")] * out[1][out_l.index("f")]
    return rows * rhs[1][rhs_l.index("i")] * taps


def source_of(ins: Instr, tables: dict) -> str:
    m = re.search(r'source_file="([^"]*)"\s+source_line=(\d+)', ins.attrs)
    if m:
        return f"{m.group(1)}:{m.group(2)}"
    frame = re.search(r"stack_frame_id=(\d+)", ins.attrs)
    if not frame:
        return "?"
    frames, locs, files = tables["StackFrames"], tables["FileLocations"], tables["FileNames"]
    where, frame_id = [], int(frame.group(1))
    # The innermost frames first (a helper's line, then its caller's), up to three.
    while frame_id and len(where) < 3:
        f = frames.get(frame_id, "")
        loc_id = re.search(r"file_location_id=(\d+)", f)
        loc = locs.get(int(loc_id.group(1)), "") if loc_id else ""
        file_id, line = re.search(r"file_name_id=(\d+)", loc), re.search(r"\bline=(\d+)", loc)
        name = files.get(int(file_id.group(1)), "?").strip('"') if file_id else "?"
        where.append(f"{Path(name).name}:{line.group(1) if line else '?'}")
        parent = re.search(r"parent_frame_id=(\d+)", f)
        nxt = int(parent.group(1)) if parent else 0
        frame_id = 0 if nxt == frame_id else nxt
    return " < ".join(where) or "?"


def analyze(text: str, unknown_trips: int = 1) -> dict:
    comps, entry, by_name, tables = parse_module(text)
    if entry is None:
        raise ValueError("no ENTRY computation: not an HLO module's text")
    runs, unknown = executions(comps, entry, by_name, unknown_trips)
    dots: list[Dot] = []
    kernels = Counter()
    for comp, m in runs.items():
        for ins in comps[comp]:
            if ins.opcode == "custom-call" and "tpu_custom_call" in ins.attrs:
                kernels["tpu_custom_call"] += m
            if ins.opcode not in ("dot", "convolution"):
                continue
            macs = _macs(ins, by_name)
            lhs, rhs = _operand(ins, 0, by_name), _operand(ins, 1, by_name)
            if macs is None or lhs is None:
                continue
            # A float32 operand makes it a float32 dot (XLA:TPU rounds it by the dot's precision).
            dtype = "f32" if "f32" in (lhs[0], rhs[0] if rhs else None) else lhs[0]
            precision, passes = _precision(ins.attrs)
            if dtype != "f32" and not precision.startswith("dot_"):
                passes = 1  # bf16 (and integer) operands: one pass whatever the precision says
            dots.append(Dot(ins.name, ins.opcode, dtype, precision, passes, macs, m, source_of(ins, tables)))
    flops = sum(d.flops for d in dots)
    mxu = sum(d.mxu_flops for d in dots)
    f32 = [d for d in dots if d.dtype == "f32"]
    by_precision = Counter()
    for d in dots:
        by_precision[f"{d.dtype}/{d.precision}"] += d.flops
    return {
        "dots": len(dots),
        "dot_flops": flops,
        "mxu_flops": mxu,
        "flops_by_dtype_precision": dict(by_precision),
        "f32_dots": len(f32),
        "f32_dot_flops": sum(d.flops for d in f32),
        "f32_mxu_flops": sum(d.mxu_flops for d in f32),
        "f32_dot_list": [
            {
                "name": d.name,
                "precision": d.precision,
                "passes": d.passes,
                "runs": d.runs,
                "flops": d.flops,
                "source": d.source,
            }
            for d in sorted(f32, key=lambda d: -d.mxu_flops)
        ],
        "pallas_kernel_calls": kernels.get("tpu_custom_call", 0),
        "loops_without_trip_count": unknown,
        "unknown_trips": unknown_trips,
    }


def format_report(r: dict, top: int = 20) -> str:
    def g(x):
        return f"{x / 1e9:,.3f} GFLOP"

    lines = [
        f"matmuls: {r['dots']} dot/convolution instructions, {g(r['dot_flops'])} per run (trip-count weighted)",
        f"MXU-pass weighted: {g(r['mxu_flops'])} ({r['mxu_flops'] / max(r['dot_flops'], 1):.2f}x the matmul FLOPs)",
    ]
    for k, v in sorted(r["flops_by_dtype_precision"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:28s} {g(v)}")
    lines.append(
        f"float32 dots: {r['f32_dots']}, {g(r['f32_dot_flops'])} ({g(r['f32_mxu_flops'])} in MXU passes)"
    )
    for d in r["f32_dot_list"][:top]:
        lines.append(
            f"  {d['precision']:>8s} x{d['passes']} runs {d['runs']:>6d} {g(d['flops']):>18s}  {d['source']}  ({d['name']})"
        )
    if len(r["f32_dot_list"]) > top:
        lines.append(f"  ... {len(r['f32_dot_list']) - top} more (--top N, or --json)")
    lines.append(f"Pallas (Mosaic) kernel calls per run: {r['pallas_kernel_calls']}")
    if r["loops_without_trip_count"]:
        lines.append(
            f"loops with a data-dependent trip count, counted {r['unknown_trips']} time(s) each "
            f"(--unknown-trips): {', '.join(r['loops_without_trip_count'])}"
        )
    if "model_flops_ratio" in r:
        lines.append(
            f"model FLOPs per device {g(r['model_flops_per_device'])}: {r['model_flops_ratio']:.3f} of the "
            f"matmul FLOPs, {r['model_flops_ratio_mxu']:.3f} of the MXU-pass weighted"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hlo", nargs="+", help="HLO text files (compiled.as_text())")
    p.add_argument(
        "--model-flops", type=float, help="the model's FLOPs for one run of the program, all devices"
    )
    p.add_argument("--devices", type=int, default=1, help="devices the model FLOPs are spread over")
    p.add_argument("--top", type=int, default=20, help="float32 dots listed (text output)")
    p.add_argument(
        "--unknown-trips",
        type=int,
        default=1,
        help="trips assumed for loops whose count depends on the data (e.g. the LM head's chunks)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for path in args.hlo:
        r = analyze(Path(path).read_text(), args.unknown_trips)
        r["hlo"] = path
        if args.model_flops:
            per_device = args.model_flops / args.devices
            r["model_flops_per_device"] = per_device
            r["model_flops_ratio"] = per_device / max(r["dot_flops"], 1)
            r["model_flops_ratio_mxu"] = per_device / max(r["mxu_flops"], 1)
        if args.json:
            print(json.dumps(r))
        else:
            print(f"== {path}")
            print(format_report(r, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
