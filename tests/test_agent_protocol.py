import pytest

from tmax_jax.agent import (
    SUBMIT_MARKER,
    FormatError,
    format_tool_result,
    parse_terminus_reply,
    parse_tool_calls,
    render_tool_call,
)
from tmax_jax.agent.protocol import is_submit, truncate_middle


def test_round_trip_of_rendered_call_keeps_multiline_command():
    cmd = "cd /app &&\ncat <<'X' > f.txt\nhello </parameter-ish\nX"
    calls = parse_tool_calls("I will write the file.\n" + render_tool_call(cmd))
    assert [c.command for c in calls] == [cmd]


def test_several_calls_in_order():
    text = render_tool_call("ls") + "\n" + render_tool_call("pwd")
    assert [c.command for c in parse_tool_calls(text)] == ["ls", "pwd"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("just prose", "no tool call found"),
        ("<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>", "unbalanced"),
        (
            "<tool_call><function=python><parameter=code>1</parameter></function></tool_call>",
            "unknown tool 'python'",
        ),
        (
            "<tool_call><function=bash><parameter=cmd>ls</parameter></function></tool_call>",
            "parameter=command",
        ),
        ("<tool_call>ls -la</tool_call>", "exactly one <function=NAME>"),
        (
            "<tool_call><function=bash>junk<parameter=command>ls</parameter></function></tool_call>",
            "unexpected text",
        ),
    ],
)
def test_malformed_calls_name_the_problem(text, message):
    with pytest.raises(FormatError, match=message):
        parse_tool_calls(text)


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
