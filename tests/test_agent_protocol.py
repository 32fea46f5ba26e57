import pytest

from tmax_jax.agent import (
    SUBMIT_MARKER,
    FormatError,
    format_tool_result,
    parse_terminus_reply,
    parse_tool_calls,
    render_tool_call,
)
from tmax_jax.agent.protocol import is_submit, parse_reply, truncate_middle

OPENHANDS_TOOLS = {"execute_bash": ("command",), "str_replace_editor": ("command", "path"), "finish": ()}


def test_round_trip_of_rendered_call_keeps_multiline_command():
    cmd = "cd /app &&\ncat <<'X' > f.txt\nhello </parameter-ish\nX"
    calls = parse_tool_calls("I will write the file.\n" + render_tool_call(cmd))
    assert [c.command for c in calls] == [cmd]


def test_several_calls_in_order():
    text = render_tool_call("ls") + "\n" + render_tool_call("pwd")
    assert [c.command for c in parse_tool_calls(text)] == ["ls", "pwd"]


# Shapes sampled models emit (the failure modes reported against Qwen3-Coder/Qwen 3.5 tool parsers:
# a value closed by </function> under long context, a reply cut at the token limit, tags said twice,
# Hermes-style JSON, calls in a think block or a markdown fence).
TOLERATED = [
    (
        "cut at the token limit",
        "Let me look.\n<tool_call>\n<function=bash>\n<parameter=command>\nls /app\n",
        ["ls /app"],
    ),
    (
        "cut after blank lines",
        "<tool_call>\n<function=bash>\n<parameter=command>\nls /app\n\n\n",
        ["ls /app"],
    ),
    (
        "</parameter> dropped",
        "<tool_call>\n<function=bash>\n<parameter=command>\ncat big.log | tail\n</function>\n</tool_call>",
        ["cat big.log | tail"],
    ),
    (
        "</tool_call> dropped",
        "<tool_call>\n<function=bash>\n<parameter=command>\npwd\n</parameter>\n</function>",
        ["pwd"],
    ),
    (
        "every tag twice",
        "<tool_call>\n<tool_call>\n<function=bash>\n<function=bash>\n<parameter=command>\n<parameter=command>\n"
        "ls -la\n</parameter>\n</function>\n</tool_call>\n</tool_call>",
        ["ls -la"],
    ),
    (
        "hermes json",
        '<tool_call>\n{"name": "bash", "arguments": {"command": "wc -l f"}}\n</tool_call>',
        ["wc -l f"],
    ),
    (
        "json arguments as a string",
        '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"date\\"}"}</tool_call>',
        ["date"],
    ),
    (
        "json inside the function",
        '<tool_call>\n<function=bash>\n{"command": "id -u"}\n</function>\n</tool_call>',
        ["id -u"],
    ),
    ("no wrapper", "<function=bash>\n<parameter=command>\nuname -a\n</parameter>\n</function>", ["uname -a"]),
    (
        "second call opened before the first closed",
        "<tool_call>\n<function=bash>\n<parameter=command>\nmkdir d\n</parameter>\n"
        "<tool_call>\n<function=bash>\n<parameter=command>\nls d\n</parameter>\n</function>\n</tool_call>",
        ["mkdir d", "ls d"],
    ),
    (
        "call inside thinking is not run",
        "<think>I could <tool_call><function=bash><parameter=command>rm -rf /app</parameter></function>"
        "</tool_call> but no.</think>\n" + render_tool_call("ls"),
        ["ls"],
    ),
    (
        "generation prompt opened the think block",
        "hmm, list first\n</think>\n\n" + render_tool_call("ls /"),
        ["ls /"],
    ),
    (
        "markdown fence and prose",
        "Sure!\n```xml\n" + render_tool_call("echo hi") + "\n```\nThat should work.",
        ["echo hi"],
    ),
]


@pytest.mark.parametrize("what, text, commands", TOLERATED, ids=[t[0] for t in TOLERATED])
def test_tolerated_malformed_calls(what, text, commands):
    parsed = parse_reply(text, ("bash",))
    assert parsed.problems == []
    assert [c.name for c in parsed.calls] == ["bash"] * len(commands)
    assert [c.command for c in parsed.calls] == commands


@pytest.mark.parametrize(
    "text, message",
    [
        ("just prose", "no tool call found"),
        (
            "<tool_call><function=python><parameter=code>1</parameter></function></tool_call>",
            "unknown tool 'python'",
        ),
        (
            "<tool_call><function=bash><parameter=cmd>ls</parameter></function></tool_call>",
            "parameter=command",
        ),
        ("<tool_call>ls -la</tool_call>", "must contain <function=NAME>"),
        # The parameter header lost its '>' (a truncated or garbled tag): the value is not guessed.
        (
            "<tool_call>\n<function=bash>\n<parameter=command\nls\n</parameter>\n</function>\n</tool_call>",
            "parameter=command",
        ),
        (
            "<tool_call><function=bash><parameter=command>ls</parameter><parameter=command>rm x</parameter></function></tool_call>",
            "given twice with different values",
        ),
        ('<tool_call>{"name": "bash", "arguments": "not json"}</tool_call>', "not a JSON object"),
    ],
)
def test_unreadable_calls_name_the_problem(text, message):
    with pytest.raises(FormatError, match=message):
        parse_tool_calls(text)


def test_a_bad_call_does_not_hide_good_ones():
    text = (
        render_tool_call("ls")
        + "<tool_call><function=nope><parameter=x>1</parameter></function></tool_call>"
        + "<tool_call>\n<function=str_replace_editor>\n<parameter=command>\nview\n</parameter>\n"
        "<parameter=path>\n/app\n</parameter>\n</function>\n</tool_call>"
    )
    parsed = parse_reply(text, {"bash": ("command",), **OPENHANDS_TOOLS})
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("bash", {"command": "ls"}),
        ("str_replace_editor", {"command": "view", "path": "/app"}),
    ]
    assert parsed.problems == [
        "unknown tool 'nope'; available tools: bash, execute_bash, str_replace_editor, finish"
    ]
    # A tool with no required parameters, called with none.
    assert (
        parse_reply("<tool_call>\n<function=finish>\n</function>\n</tool_call>", OPENHANDS_TOOLS)
        .calls[0]
        .name
        == "finish"
    )


def test_tool_result_truncates_with_marker_and_exit_code():
    out = "a" * 100 + "b" * 100
    res = format_tool_result(out, 3, max_chars=50)
    assert res.startswith("a" * 25) and "[... 150 characters truncated ...]" in res
    assert res.endswith("b" * 25 + "\n(exit_code=3)")
    assert format_tool_result("", 0) == "(exit_code=0)"
    assert "timed out" in format_tool_result("x", None, timed_out=True)
    assert len(truncate_middle("x" * 10, 100)) == 10


def test_submit_marker():
    assert is_submit(f"{SUBMIT_MARKER}\n")
    assert not is_submit(f"done? {SUBMIT_MARKER}")


def test_terminus_reply_parses_and_validates():
    r = parse_terminus_reply(
        'Sure:\n```json\n{"analysis": "a {brace}", "plan": "p", "commands": '
        '[{"keystrokes": "ls\\n", "duration": 0.5}], "task_complete": false}\n```'
    )
    assert r.analysis == "a {brace}" and r.commands[0].keystrokes == "ls\n" and r.commands[0].duration == 0.5
    assert parse_terminus_reply('{"commands": [], "task_complete": true}').task_complete
    for bad, msg in [
        ("no json", "no JSON object"),
        ('{"commands": "ls"}', "'commands' must be a list"),
        ('{"commands": [{"keys": "ls"}]}', r"commands\[0\]"),
        ('{"commands": [{"keystrokes": "ls", "duration": -1}]}', "non-negative"),
        ('{"task_complete": "yes"}', "task_complete"),
        ('{"analysis": 1,}', "not valid JSON"),
    ]:
        with pytest.raises(FormatError, match=msg):
            parse_terminus_reply(bad)
