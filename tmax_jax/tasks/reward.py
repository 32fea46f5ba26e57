"""The reward contract: what a verifier may write to ``/logs/verifier``, and what it scores.

The rule (one for Harbor and TMAX tasks alike):

* ``reward.txt`` holds exactly one finite decimal number (``1``, ``0.25``, ``-3``, ``5e-1``),
  optionally surrounded by whitespace. Anything else is an error: an empty file, more than one
  token (``1 ... tests FAILED``), words, ``nan``/``inf``, a number that overflows (``1e400``), bytes
  that are not UTF-8.
* ``reward.json`` is either one JSON number, or an object whose values are all JSON numbers; THE
  reward is the object's ``"reward"`` key (what Harbor writes: ``{"reward": x}``), the other keys are
  extra metrics and must be numbers too. Booleans, strings (even ``"1"``), ``null``, lists, nested
  objects, duplicate keys, ``NaN``/``Infinity`` and overflowing numbers are errors, and so is an object
  without a ``"reward"`` key.
* When both files exist, ``reward.txt`` wins (the order the runner has always read them in) and the
  reading's note says that ``reward.json`` was ignored.
* THE reward must lie in [0, 1]; the other keys of ``reward.json`` are only required to be numbers.
  A value in [0, 1] is the reward as is. A value at most ``REWARD_TOLERANCE`` (1e-6) outside it is
  float rounding in a graded verifier (``1.0000000001``, ``-1e-09``): it is clamped to [0, 1] and the
  note says so (``reward 1.0000000001 clamped to 1``). Any other finite value (``1.5``, ``-1``,
  ``1e308``) is an error (``reward.txt: reward 1.5 is outside [0, 1]``): outcome-only RL must never
  pay for an out-of-contract value, e.g. a verifier tricked into relaying the agent's ``1e308``.
* An error scores 0 and carries the reason. No reward file at all is ``value=None`` (the caller
  decides: a Harbor task then scores 0, a TMAX task falls back to pytest's exit status).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

REWARD_FILES = ("reward.txt", "reward.json")
REWARD_KEY = "reward"
# How far outside [0, 1] a reward may be and still count as rounding (then clamped); beyond it, an error.
REWARD_TOLERANCE = 1e-6
# A reward is a number, not a document: anything larger is an error before parsing.
MAX_TXT_BYTES = 4096
MAX_JSON_BYTES = 64 << 10
_SNIPPET = 80

# A plain decimal number. Python's float() would also take 'nan', 'inf', 'infinity', '1_0' and
# non-ASCII digits; none of those is a reward.
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class RewardReading:
    """value: the score in [0, 1] (0.0 on an error), or None when no reward file exists.
    error: why the files were not a valid reward (then value == 0.0). note: what was adjusted on the
    way (clamping a rounding error, an ignored second file)."""

    value: float | None
    error: str | None = None
    note: str | None = None


class _Invalid(Exception):
    pass


def _snippet(raw: bytes | str) -> str:
    text = raw if isinstance(raw, str) else raw.decode("utf-8", errors="replace")
    return repr(text[:_SNIPPET] + ("..." if len(text) > _SNIPPET else ""))


def _decode(name: str, raw: bytes, limit: int) -> str:
    if len(raw) > limit:
        raise _Invalid(f"{name} is {len(raw)} bytes (at most {limit}): {_snippet(raw)}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Invalid(f"{name} is not UTF-8 text: {_snippet(raw)}") from None


def _finite(text: str, name: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Invalid(f"{name}: {_snippet(text)[1:-1]} is not a finite number")
    return value


def _read_txt(raw: bytes) -> float:
    text = _decode("reward.txt", raw, MAX_TXT_BYTES).strip()
    if not text:
        raise _Invalid("reward.txt is empty")
    if not _NUMBER.fullmatch(text):
        if len(text.split()) > 1:
            raise _Invalid(
                f"reward.txt must hold one number, got {len(text.split())} words: {_snippet(text)}"
            )
        raise _Invalid(f"reward.txt is not a finite decimal number: {_snippet(text)}")
    return _finite(text, "reward.txt")


def _reject_constant(token: str):
    raise _Invalid(f"reward.json: {token} is not a finite number")


def _json_float(text: str) -> float:
    # Integers too: a 400-digit integer literal is as much an overflow as 1e400.
    return _finite(text, "reward.json")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _Invalid(f"reward.json: key {k!r} appears more than once")
        out[k] = v
    return out


def _json_number(value: object, what: str) -> float:
    # bool is an int subclass in Python: test it first, `true` is not a reward.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if value is None:
            raise _Invalid(f"reward.json: {what} must be a number, got null")
        kind = {"bool": "boolean", "str": "string", "dict": "object", "list": "array"}[type(value).__name__]
        raise _Invalid(f"reward.json: {what} must be a number, got {kind} {json.dumps(value)[:_SNIPPET]}")
    return float(value)


def _read_json(raw: bytes) -> tuple[float, str]:
    """THE reward and where it came from (for the error message)."""
    text = _decode("reward.json", raw, MAX_JSON_BYTES)
    if not text.strip():
        raise _Invalid("reward.json is empty")
    try:
        data = json.loads(
            text,
            parse_float=_json_float,
            parse_int=_json_float,
            parse_constant=_reject_constant,
            object_pairs_hook=_unique_keys,
        )
    except (ValueError, RecursionError) as e:
        raise _Invalid(f"reward.json is not valid JSON ({e}): {_snippet(text)}") from None
    if not isinstance(data, dict):
        return _json_number(data, "the value"), "reward.json"
    for k, v in data.items():
        _json_number(v, f"key {k!r}")
    if REWARD_KEY not in data:
        keys = ", ".join(repr(k) for k in data) or "none"
        raise _Invalid(f'reward.json has no "{REWARD_KEY}" key (keys: {keys})')
    return float(data[REWARD_KEY]), f'reward.json key "{REWARD_KEY}"'


def _fmt(x: float) -> str:
    # Shortest round-trip decimal, so 1.0000000001 is not shown as 1; integers without ".0".
    text = repr(x)
    return text[:-2] if text.endswith(".0") else text


def _in_contract(value: float, where: str) -> tuple[float, str | None]:
    """The reward for a finite ``value`` read from ``where``, and a note if it was clamped."""
    if 0.0 <= value <= 1.0:
        return value + 0.0, None  # + 0.0 turns -0.0 into 0.0
    # Near 1, value - 1.0 is exact (Sterbenz), so this compares the true distance to the interval.
    if -REWARD_TOLERANCE <= value < 0.0 or 0.0 < value - 1.0 <= REWARD_TOLERANCE:
        clamped = 0.0 if value < 0.0 else 1.0
        return clamped, f"reward {_fmt(value)} clamped to {_fmt(clamped)}"
    raise _Invalid(
        f"{where}: reward {_fmt(value)} is outside [0, 1] (beyond the {REWARD_TOLERANCE:g} rounding tolerance)"
    )


def parse_reward(files: dict[str, bytes]) -> RewardReading:
    """Read the verifier's reward from ``files`` (file name -> bytes, e.g. ``VerifierRun.logs``).

    Never raises for bad content: every violation of the contract above is a reading with
    ``value=0.0`` and ``error`` set. Names other than reward.txt / reward.json are ignored.
    """
    present = [n for n in REWARD_FILES if n in files]
    if not present:
        return RewardReading(None)
    name = present[0]
    notes = []
    if len(present) > 1:
        notes.append(f"{present[1]} ignored: {name} takes precedence")
    raw = files[name]
    if not isinstance(raw, (bytes, bytearray)):
        raise TypeError(f"parse_reward: files[{name!r}] must be bytes, got {type(raw).__name__}")
    try:
        if name == "reward.txt":
            value, where = _read_txt(bytes(raw)), "reward.txt"
        else:
            value, where = _read_json(bytes(raw))
        reward, clamp_note = _in_contract(value, where)
    except _Invalid as e:
        return RewardReading(0.0, error=str(e), note="; ".join(notes) or None)
    if clamp_note:
        notes.append(clamp_note)
    return RewardReading(reward, note="; ".join(notes) or None)
