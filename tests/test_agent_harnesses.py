"""The harnesses against a real bwrap sandbox: mini-swe subshells, the OpenHands tools and file
editor, the Terminus-2 tmux terminal; a scripted agent solves the example tasks under each."""

import json
import shlex
from pathlib import Path

import pytest

from tmax_jax.agent.editor import EditorError, FileEditor
from tmax_jax.agent.episode import AgentConfig, make_chat, run_episode
from tmax_jax.agent.harness import HARNESSES, get_harness
from tmax_jax.agent.protocol import SUBMIT_MARKER, render_function_call
from tmax_jax.agent.scripted import ScriptedPolicy
from tmax_jax.agent.terminus import LineTerminal
from tmax_jax.errors import ConfigError
from tmax_jax.sandbox import SandboxConfig, make_sandbox
from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task
from tmax_jax.tokenizer import train_tiny_tokenizer

TASKS = Path(__file__).parent / "tasks"


@pytest.fixture(scope="module")
def sandbox():
    with make_sandbox(SandboxConfig()) as sb:
        yield sb


@pytest.fixture()
def shell(sandbox):
    sh = sandbox.shell()
    yield sh
    sh.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def cat(sandbox, path):
    return sandbox.exec(f"cat {path}").stdout


# ---- mini-swe -------------------------------------------------------------------------------------
def test_mini_swe_one_block_fresh_subshell_and_submit(sandbox, shell):
    s = get_harness("mini-swe").start(shell, AgentConfig(harness="mini-swe"))
    step = s.act("THOUGHT: go.\n\n```bash\ncd /tmp && export V=1 && echo here:$(pwd)\n```")
    assert step.observation == "<returncode>0</returncode>\n<output>\nhere:/tmp\n</output>" and not step.done
    # cd and export did not persist: each action is a new shell in the task directory.
    step = s.act("```bash\necho ${V:-unset} $(pwd); exit 3\n```")
    assert step.observation == "<returncode>3</returncode>\n<output>\nunset /app\n</output>"
    for reply, what in [
        ("no block here", "no ```bash block"),
        ("```bash\nls\n```\n```bash\npwd\n```", "2 ```bash"),
    ]:
        step = s.act(reply)
        assert step.format_errors == 1 and what in step.observation and not step.done
    long = s.act("```bash\nseq 1 5000\n```").observation
    assert "<note>The output had" in long and "characters truncated" in long
    assert long.startswith("<returncode>0</returncode>") and long.rstrip().endswith("5000\n</output>")
    assert s.act(f"Done.\n```bash\necho {SUBMIT_MARKER}\n```").done


# ---- OpenHands: the file editor ---------------------------------------------------------------------
def test_editor_view_create_replace_insert_undo(sandbox, shell):
    ed = FileEditor(shell)
    path = "/app/ed/notes.txt"
    assert ed("create", path, file_text="alpha\nbeta\ngamma\nbeta\n").startswith(f"Created {path}")
    assert cat(sandbox, path) == "alpha\nbeta\ngamma\nbeta\n"
    with pytest.raises(EditorError, match="already exists"):
        ed("create", path, file_text="x")
    # view: cat -n numbering, ranges with -1 meaning the end.
    assert ed("view", path).split("\n", 1)[1] == "     1\talpha\n     2\tbeta\n     3\tgamma\n     4\tbeta"
    assert ed("view", path, view_range=[3, -1]).endswith("     3\tgamma\n     4\tbeta")
    with pytest.raises(EditorError, match="outside the file"):
        ed("view", path, view_range=[2, 9])
    # str_replace needs exactly one match, and names the lines of several.
    with pytest.raises(EditorError, match=r"occurs 2 times .*lines 2, 4"):
        ed("str_replace", path, old_str="beta", new_str="B")
    with pytest.raises(EditorError, match="does not occur verbatim"):
        ed("str_replace", path, old_str="delta", new_str="D")
    assert cat(sandbox, path) == "alpha\nbeta\ngamma\nbeta\n"  # nothing changed by the refusals
    out = ed("str_replace", path, old_str="gamma\nbeta", new_str="GAMMA\nBETA")
    assert cat(sandbox, path) == "alpha\nbeta\nGAMMA\nBETA\n" and "     3\tGAMMA" in out
    ed("insert", path, insert_line=0, new_str="top")
    ed("insert", path, insert_line=5, new_str="end1\nend2")
    assert cat(sandbox, path) == "top\nalpha\nbeta\nGAMMA\nBETA\nend1\nend2\n"
    with pytest.raises(EditorError, match=r"outside the file \(0..7\)"):
        ed("insert", path, insert_line=9, new_str="x")
    # undo walks back one edit at a time; undoing the create removes the file.
    ed("undo_edit", path)
    ed("undo_edit", path)
    assert cat(sandbox, path) == "alpha\nbeta\nGAMMA\nBETA\n"
    ed("undo_edit", path)
    assert cat(sandbox, path) == "alpha\nbeta\ngamma\nbeta\n"
    assert "removed" in ed("undo_edit", path)
    assert sandbox.exec(f"test -e {path}").exit_code == 1
    with pytest.raises(EditorError, match="no edit"):
        ed("undo_edit", path)
    with pytest.raises(EditorError, match="absolute"):
        ed("view", "app/ed")
    assert "/app/ed" in ed("view", "/app/ed") and "2 levels deep" in ed("view", "/app")
    # Content the shell would mangle survives the trip (quotes, $vars, a heredoc end word, no final newline).
    tricky = "a 'q' \"d\" $HOME `x`\n__TMAX_EDIT_EOF\n\\n tab\tend"
    ed("create", "/app/ed/t.txt", file_text=tricky)
    assert sandbox.read_file("/app/ed/t.txt").decode() == tricky
    ed("str_replace", "/app/ed/t.txt", old_str="$HOME", new_str="$PATH")
    assert sandbox.read_file("/app/ed/t.txt").decode() == tricky.replace("$HOME", "$PATH")
    # Files too large to move whole through the shell's output cap, and binary files, are refused.
    sandbox.exec("head -c 300000 /dev/zero | tr '\\0' x > /app/ed/big.txt; printf '\\xff\\xfe' > /app/ed/bin")
    with pytest.raises(EditorError, match="too large"):
        ed("view", "/app/ed/big.txt")
    with pytest.raises(EditorError, match="not a UTF-8 text file"):
        ed("str_replace", "/app/ed/bin", old_str="a", new_str="b")


def test_openhands_tools_through_xml_calls(sandbox, shell):
    cfg = AgentConfig(harness="openhands", command_timeout_s=5.0)
    s = get_harness("openhands").start(shell, cfg)
    create = render_function_call(
        "str_replace_editor", {"command": "create", "path": "/app/oh/app.py", "file_text": "print('v1')\n"}
    )
    run = render_function_call("execute_bash", {"command": "cd /app/oh && python3 app.py"})
    step = s.act("First write the app, then run it.\n" + create + "\n" + run)
    assert (
        "Created /app/oh/app.py" in step.observation and "v1\n[exit code 0, cwd /app/oh]" in step.observation
    )
    replace = render_function_call(
        "str_replace_editor",
        {"command": "str_replace", "path": "/app/oh/app.py", "old_str": "v1", "new_str": "v2"},
    )
    view = render_function_call(
        "str_replace_editor", {"command": "view", "path": "/app/oh/app.py", "view_range": "[1, 1]"}
    )
    step = s.act(replace + view)
    assert step.format_errors == 0 and "     1\tprint('v2')" in step.observation
    # A tool error is the tool's answer, not a format error.
    bad = s.act(render_function_call("str_replace_editor", {"command": "view", "path": "/nope"}))
    assert bad.observation == "Error: /nope does not exist" and bad.format_errors == 0
    # The timeout stops a command; a command ending in & runs on in the background with a log.
    slow = s.act(render_function_call("execute_bash", {"command": "sleep 30", "timeout": "1"}))
    assert "ran past its 1s timeout and was stopped" in slow.observation
    bg = s.act(
        render_function_call("execute_bash", {"command": "for i in 1 2 3; do echo tick$i; sleep 0.2; done &"})
    )
    assert "[started in the background: pid" in bg.observation and "/tmp/tmax-bg-1.log" in bg.observation
    after = s.act(render_function_call("execute_bash", {"command": "sleep 1; cat /tmp/tmax-bg-1.log"}))
    assert "tick1\ntick2\ntick3" in after.observation
    # The shell persisted through all of it (cwd from the first call).
    assert "cwd /app/oh" in after.observation
    missing = s.act(
        "<tool_call><function=str_replace_editor><parameter=command>view</parameter></function></tool_call>"
    )
    assert missing.format_errors == 1 and "needs <parameter=path>" in missing.observation
    assert s.act(render_function_call("finish", {"message": "ok"})).done


# ---- Terminus-2: the terminal -----------------------------------------------------------------------
def _reply(*commands, complete=False):
    cmds = [{"keystrokes": k, "duration": d} for k, d in commands]
    return (
        "```json\n"
        + json.dumps({"analysis": "a", "plan": "p", "commands": cmds, "task_complete": complete})
        + "\n```"
    )


def test_terminus_keystrokes_into_a_persistent_tmux_terminal(sandbox, shell):
    s = get_harness("terminus").start(shell, AgentConfig(harness="terminus"))
    # Typing without Enter leaves the line at the prompt; the next reply's Enter runs it.
    step = s.act(_reply(("cd /tmp && echo typed-", 0.2)))
    assert step.observation.rstrip().endswith("# cd /tmp && echo typed-")
    step = s.act(_reply(("line\n", 5)))
    screen = step.observation
    assert screen.startswith("Terminal screen:\n") and "\ntyped-line\n" in screen
    # A long job keeps running past its duration (the screen shows no new prompt); C-c interrupts it.
    step = s.act(_reply(("sleep 60; echo never\n", 0.5)))
    assert step.observation.rstrip().endswith("sleep 60; echo never")
    step = s.act(_reply(("C-c", 0.5), ("pwd\n", 5)))
    assert "^C" in step.observation and step.observation.rstrip().endswith("/tmp\nroot@tmax-sandbox:/tmp#")
    assert "never" not in step.observation.split("echo never", 1)[1]
    # An interactive program gets the keystrokes too.
    step = s.act(_reply(("python3 -q\n", 1.0), ("print(6 * 7)\n", 0.5), ("C-d", 0.5)))
    assert "\n42\n" in step.observation
    # Malformed JSON is a counted format error; task_complete is confirmed once before it ends.
    assert s.act("sure, done").format_errors == 1
    first = s.act(_reply(complete=True))
    assert not first.done and "task_complete" in first.observation
    assert s.act(_reply(complete=True)).done


def test_line_terminal_without_tmux(shell):
    term = LineTerminal(shell, timeout=5.0)
    term.send("cd /tmp && echo a", 1)
    term.send("b\n", 1)
    term.send("pwd\n", 1)
    term.send("half typed", 1)
    term.send("C-c", 1)
    assert term.screen() == "$ cd /tmp && echo ab\nab\n$ pwd\n/tmp\n$ half typed^C\n$ "


# ---- every harness: configs, prompts, and the example tasks solved -------------------------------------
def test_harness_config_and_prompts():
    with pytest.raises(ConfigError, match="agent.harness='swe'"):
        AgentConfig(harness="swe")
    assert AgentConfig(harness="mini-swe").prompt() == get_harness("mini-swe").system_prompt
    assert AgentConfig(harness="terminus", system_prompt="mine").prompt() == "mine"
    assert [t["function"]["name"] for t in get_harness("openhands").tools] == [
        "execute_bash",
        "str_replace_editor",
        "finish",
    ]
    assert get_harness("terminus").tools is None and get_harness("mini-swe").tools is None


@pytest.mark.parametrize("harness", HARNESSES)
def test_scripted_agent_solves_the_example_tasks(harness, tokenizer):
    cfg = AgentConfig(harness=harness, max_tokens_per_turn=4096, max_context_tokens=32768)
    chat = make_chat(tokenizer, cfg)
    names = ["harbor_csv_sum"] + (["tmax_log_errors"] if harness == "openhands" else [])
    for name in names:
        task = load_task(TASKS / name)
        script = task.solution.read_text()
        if harness == "openhands":  # write the solution with the editor, then run it
            replies = [
                render_function_call(
                    "str_replace_editor", {"command": "create", "path": "/tmp/solve.sh", "file_text": script}
                ),
                render_function_call("execute_bash", {"command": "bash /tmp/solve.sh"}),
                *get_harness(harness).render_submit(),
            ]
            policy = ScriptedPolicy([], chat, replies=replies)
        else:
            policy = ScriptedPolicy([f"bash -c {shlex.quote(script)}"], chat, harness=harness)
        result = run_task(
            task,
            lambda t, sh, policy=policy: run_episode(t.instruction, policy, sh, chat, cfg, task_id=t.name),
            SandboxConfig(),
        )
        traj = result.agent_output
        assert (result.reward, traj.finish_reason, traj.num_format_errors) == (1.0, "submitted", 0), (
            result.reason
        )
        assert traj.info["harness"] == harness
        roles = {m["role"] for m in traj.messages[2:]}
        assert roles == {"assistant", get_harness(harness).observation_role}
        # The token stream holds the harness's tool schemas exactly when it has tools.
        text = chat.decode(traj.tokens)
        assert ("execute_bash" in text) == (harness == "openhands")
