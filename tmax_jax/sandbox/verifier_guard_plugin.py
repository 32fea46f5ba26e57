# Written by tmax-jax for the verifier (tmax_jax/sandbox/verifier_guard_plugin.py, copied into the
# verifier's own /tests and loaded by PYTEST_PLUGINS in every pytest it runs). Never imported on the
# host. Plain Python 3.6+ and pytest 6+: it runs on whatever the task's image has.
#
# Many verifiers run the agent's code inside pytest's process (import its module, call its function).
# That code can end the session early with status 0 (os._exit, pytest.exit), mark the tests skipped
# or xfailed (pytest.skip, unittest.SkipTest), swap pytest's runner or register a hook that rewrites
# reports, or kill the shell that would write reward 0. This plugin notices those: it turns the
# affected tests and the session into failures (so the verifier's own logic writes 0) and leaves a
# record in $TMAX_GUARD_DIR, read by the host (``verifier_guard.py``), which scores 0 with the reason.
# Code inside the process can always undo what is checked from inside it; this stops the simple,
# learnable ways, and the host side catches a session that never finished.
import json
import os
import sys
import time

import _pytest.main
import _pytest.nodes
import _pytest.outcomes
import _pytest.python
import _pytest.reports
import _pytest.runner
import _pytest.skipping
import pluggy
import pytest

_TESTS = os.path.realpath(os.environ.get("TMAX_GUARD_TESTS", "/tests"))
_DIR = os.environ.get("TMAX_GUARD_DIR")
# Every file of the tests is mounted read-only (a conftest.py there that is writable was planted).
_ALL_RO = os.environ.get("TMAX_GUARD_ALL_RO") == "1"
# Set in the environment of the pytest this guards: a pytest that a test starts (a child process,
# not an xdist worker) is the test's business and is left alone.
_MARK = "TMAX_GUARD_SESSION_PID"


def _where(mod):
    f = os.path.realpath(getattr(mod, "__file__", "") or "")
    return os.path.dirname(f) if os.path.basename(f) == "__init__.py" else f


def _package_dir(path):
    """The top-level package dir holding ``path``, or ``path`` itself outside any package."""
    d, top = os.path.dirname(path), None
    while os.path.isfile(os.path.join(d, "__init__.py")):
        top, d = d, os.path.dirname(d)
    return top or path


# Code allowed to decide a test's outcome: the tests themselves, pytest, pluggy and this plugin.
_TRUSTED = [_TESTS, os.path.dirname(_where(_pytest.main)), _where(pytest), _where(pluggy)]
_TRUSTED.append(os.path.dirname(os.path.realpath(__file__)))
# Frames that only relay an outcome someone else asked for (pytest.skip(), TestCase.skipTest()).
_RELAYS = [os.path.realpath(_pytest.outcomes.__file__)]
try:
    import unittest.case

    _RELAYS.append(os.path.realpath(unittest.case.__file__))
except ImportError:  # pragma: no cover
    pass
_SKIPPING = os.path.realpath(_pytest.skipping.__file__)

# What skips or xfails a test (pytest.skip(), pytest.xfail(), unittest's SkipTest).
_SKIPS = (_pytest.outcomes.Skipped, _pytest.outcomes.XFailed)
try:
    import unittest

    _SKIPS += (unittest.SkipTest,)
except ImportError:  # pragma: no cover
    pass


def _module_file(item):
    """The test's own file (a verifier may run test files it copied out of /tests)."""
    return getattr(getattr(item, "module", None), "__file__", None) or str(getattr(item, "fspath", ""))


def _node_file(node):
    return str(getattr(node, "path", None) or getattr(node, "fspath", None) or "")


def _under(p, d):
    return p == d or p.startswith(d.rstrip(os.sep) + os.sep)


def _trusted(path, own=None):
    """Whether code in file ``path`` may decide a test's outcome: the tests' files (and those beside
    ``own``, the test's own file), pytest, pluggy, the plugins and modules loaded before any test
    module was, never code without a file (``exec``)."""
    if not path or not os.path.isabs(str(path)):
        return False
    p = os.path.realpath(str(path))
    if os.path.basename(p) == "conftest.py" and _ALL_RO and _under(p, _TESTS) and os.access(p, os.W_OK):
        return False  # written while the tests ran
    if p in _state["loaded"] or any(_under(p, d) for d in _state["plugin_dirs"]):
        return True
    if own and _under(p, os.path.dirname(os.path.realpath(str(own)))):
        return True
    return any(_under(p, t) for t in _TRUSTED)


# What runs a test and makes its report, as pytest and pluggy define them: compared by identity.
def _watched():
    out = []
    for owner, names in (
        (_pytest.python.Function, ("runtest", "setup")),
        (_pytest.python, ("pytest_pyfunc_call",)),
        (
            _pytest.runner,
            (
                "runtestprotocol",
                "call_and_report",
                "call_runtest_hook",
                "check_interactive_exception",
                "pytest_runtest_protocol",
                "pytest_runtest_call",
                "pytest_runtest_makereport",
            ),
        ),
        (_pytest.runner.CallInfo, ("from_call",)),
        (_pytest.reports.BaseReport, ("passed", "failed", "skipped")),
        (_pytest.reports.TestReport, ("from_item_and_call", "__init__")),
        (_pytest.main, ("pytest_runtestloop", "wrap_session")),
        (_pytest.main.Session, ("pytest_runtest_logreport", "pytest_collectreport")),
        (_pytest.skipping, ("evaluate_skip_marks", "evaluate_xfail_marks", "pytest_runtest_makereport")),
        (_pytest.nodes.Node, ("add_marker",)),
        (_pytest.outcomes, ("skip", "xfail", "fail", "exit")),
    ):
        for name in names:
            if name in vars(owner):
                out.append((owner, name, vars(owner)[name]))
    for modname in ("pluggy._callers", "pluggy.callers"):
        mod = sys.modules.get(modname)
        if mod is not None and "_multicall" in vars(mod):
            out.append((mod, "_multicall", vars(mod)["_multicall"]))
    for cls in (getattr(pluggy, "PluginManager", None), getattr(pluggy, "HookCaller", None)):
        if cls is None:
            continue
        for name in ("_hookexec", "__call__", "call_historic", "get_hookimpls"):
            if name in vars(cls):
                out.append((cls, name, vars(cls)[name]))
    return out


_state = {
    "record": None, "pid": None, "ppid": None, "findings": [], "snapshot": None, "ran": set(),
    "config": None, "worker": False, "inner": None, "plugin_dirs": set(), "loaded": set(),
    "pids": None, "watched": [], "failed": 0, "forced": {}, "exitstatus": None, "passive": False,
}  # fmt: skip


def _note(msg):
    if msg not in _state["findings"]:
        _state["findings"].append(msg)
    _write("finding")


def _write(status):
    path = _state["record"]
    if not path or os.getpid() != _state["pid"]:
        return
    doc = {
        "pid": _state["pid"], "argv": list(sys.argv)[:8], "status": status,
        "findings": _state["findings"][:20], "exitstatus": _state["exitstatus"],
    }  # fmt: skip
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _code_file(fn):
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    if code is None:
        mod = sys.modules.get(getattr(type(fn), "__module__", "") or "")
        return getattr(mod, "__file__", None)
    return code.co_filename


def _plugin_file(plugin):
    try:
        return getattr(plugin, "__file__", None) or _code_file(plugin)
    except Exception:
        return None


def _check_runner(when):
    """pytest's runner and pluggy's calling code as they were when collection began; no hook
    implementation added since from outside the trusted code."""
    for owner, name, orig in _state["watched"]:
        if vars(owner).get(name) is not orig:
            what = getattr(owner, "__name__", repr(owner))
            _note(f"{when}: {what}.{name} was replaced (by code under test)")
    config = _state["config"]
    if config is None or _state["snapshot"] is None:
        return
    if vars(config.pluginmanager).get("_inner_hookexec") is not _state["inner"]:
        _note(f"{when}: pytest's hook calling was replaced (by code under test)")
    for key, impl_file, plugin_file in _impls(config.pluginmanager):
        if key in _state["snapshot"] or _trusted(impl_file):
            continue
        # A conftest of the tests may import its hooks from a library (conftest: the verifier's own).
        if os.path.basename(str(plugin_file)) == "conftest.py" and _trusted(plugin_file):
            continue
        _note(f"{when}: a pytest hook implementation was added from {impl_file}")


def _impls(pm):
    out = []
    for name in dir(pm.hook):
        caller = getattr(pm.hook, name, None)
        get = getattr(caller, "get_hookimpls", None)
        if get is None:
            continue
        try:
            impls = get()
        except Exception:
            continue
        for impl in impls:
            key = (name, id(impl.plugin), id(impl.function))
            out.append((key, _code_file(impl.function), _plugin_file(impl.plugin)))
    return out


def _raiser(tb):
    """The file and line of the code that raised an outcome: the innermost frame that is not
    pytest's or unittest's relay of it."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        path = os.path.realpath(frame.f_code.co_filename)
        if path not in _RELAYS:
            return frame.f_code.co_filename, frame.f_lineno
    return "?", 0


def _outside_caller():
    """The first frame above the caller that is not pytest's or pluggy's: who asked for it."""
    f = sys._getframe(2)
    while f is not None:
        p = os.path.realpath(f.f_code.co_filename)
        if not any(_under(p, t) for t in _TRUSTED[1:4]):
            return f.f_code.co_filename, f.f_lineno
        f = f.f_back
    return None, 0


# Markers added while the tests run (``item.add_marker(pytest.mark.xfail)`` from the code under
# test), and unittest's own handling of a SkipTest (pytest then sees no exception): checked where
# they happen.
_orig_add_marker = vars(_pytest.nodes.Node).get("add_marker")


def _add_marker(self, marker, *args, **kwargs):
    name = getattr(marker, "name", None) or getattr(getattr(marker, "mark", None), "name", None) or marker
    if _state["snapshot"] is not None and str(name) in ("skip", "skipif", "xfail") and _primary(self.config):
        path, line = _outside_caller()
        if not _trusted(path, _module_file(self)):
            _note(f"{self.nodeid}: a {name} marker was added by {path}:{line}")
            _state["forced"][self.nodeid] = f"a {name} marker was added by {path}:{line}"
    return _orig_add_marker(self, marker, *args, **kwargs)


if _orig_add_marker is not None:
    _pytest.nodes.Node.add_marker = _add_marker
try:
    import _pytest.unittest as _ut

    _orig_add_skip = vars(_ut.TestCaseFunction).get("addSkip")

    def _add_skip(self, testcase, reason, *args, **kwargs):
        tb = sys.exc_info()[2]
        if tb is not None and _state["snapshot"] is not None and _primary(self.config):
            path, line = _raiser(tb)
            if not _trusted(path, _module_file(self)):
                _note(f"test {self.nodeid}: SkipTest raised by {path}:{line}")
                _state["forced"][self.nodeid] = f"SkipTest raised by {path}:{line}"
        return _orig_add_skip(self, testcase, reason, *args, **kwargs)

    if _orig_add_skip is not None:
        _ut.TestCaseFunction.addSkip = _add_skip
except ImportError:  # pragma: no cover
    pass


def _pids():
    try:
        return {int(n) for n in os.listdir("/proc") if n.isdigit()}
    except OSError:
        return None


def _ancestors():
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _kill_leftovers():
    """Kill what started during the session and still runs (a process the code under test left to
    rewrite the reward after the verifier's last write). Only in a verifier's own pid namespace."""
    before = _state["pids"]
    now = _pids()
    if before is None or now is None:
        return
    import signal

    keep = before | _ancestors() | {1}
    for _ in range(5):  # again, for what they forked meanwhile
        left = sorted(now - keep)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
        now = _pids() or set()


def _primary(config):
    """The session this process started with: a pytest run in-process by a test (pytester,
    ``pytest.main``) is left alone, and leaves this state alone."""
    return config is _state["config"] and not _state["passive"]


def pytest_configure(config):
    if _state["config"] is not None:
        return
    _state["config"] = config
    _state["worker"] = hasattr(config, "workerinput") or hasattr(config, "slaveinput")
    parent = os.environ.get(_MARK)
    if parent and parent != str(os.getpid()) and not _state["worker"]:
        _state["passive"] = True  # a pytest a test started
        return
    os.environ[_MARK] = str(os.getpid())
    if _DIR and os.environ.get("TMAX_GUARD_OWN_PIDNS") == "1" and not _state["worker"]:
        _state["pids"] = _pids()
    _state["pid"], _state["ppid"] = os.getpid(), os.getppid()
    if _DIR and _state["record"] is None:
        _state["record"] = os.path.join(_DIR, f"{os.getpid()}-{int(time.time() * 1e6)}.json")
        _write("started")


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    """As collection begins: every plugin imported and configured, no test module (nor the code
    under test it imports) yet."""
    if not _primary(session.config):
        return
    pm = session.config.pluginmanager
    _state["watched"] = _watched()
    _state["inner"] = vars(pm).get("_inner_hookexec")
    # The plugins the session started with (pytest's, the image's, the verifier's -p) and what was
    # loaded by then: theirs to skip.
    for plugin in pm.get_plugins():
        f = _plugin_file(plugin)
        if f and os.path.isabs(f):
            _state["plugin_dirs"].add(_package_dir(os.path.realpath(f)))
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and os.path.isabs(f):
            _state["loaded"].add(os.path.realpath(f))
    _state["snapshot"] = {key for key, _, _ in _impls(pm)}


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    if (
        _primary(collector.config)
        and rep is not None
        and rep.skipped
        and isinstance(rep.longrepr, tuple)
        and not _trusted(rep.longrepr[0], _node_file(collector))
    ):
        msg = f"collecting {rep.nodeid or '?'}: skipped by {rep.longrepr[0]}:{rep.longrepr[1]}"
        _note(msg)
        rep.outcome, rep.longrepr = "failed", "tmax-jax verifier guard: " + msg


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    excinfo = call.excinfo  # as raised: pytest's unittest support turns a SkipTest into its own skip
    outcome = yield
    rep = outcome.get_result()
    if not _primary(item.config):
        return
    if call.when == "call":
        _state["ran"].add(item.nodeid)
        _check_runner(f"test {item.nodeid}")
    elif rep.skipped:
        _state["ran"].add(item.nodeid)
    why = _state["forced"].pop(item.nodeid, None) if call.when == "call" else None
    if why is None and excinfo is not None and rep.skipped and excinfo.errisinstance(_SKIPS):
        path, line = _raiser(excinfo.tb)
        if not _trusted(path, _module_file(item)):
            why = f"{excinfo.typename} raised by {path}:{line}"
            _note(f"test {item.nodeid}: {why}")
    if why is not None:
        rep.outcome, rep.longrepr = "failed", "tmax-jax verifier guard: " + why
        if hasattr(rep, "wasxfail"):
            del rep.wasxfail


def pytest_runtest_logreport(report):
    if _primary(_state["config"]) and report.outcome == "failed" and not hasattr(report, "wasxfail"):
        _state["failed"] += 1


def pytest_collectreport(report):
    if _primary(_state["config"]) and report.outcome == "failed":
        _state["failed"] += 1


def pytest_keyboard_interrupt(excinfo):
    if _state["passive"]:
        return
    path, line = _raiser(excinfo.tb)
    if not _trusted(path):
        _note(f"the session was stopped ({excinfo.typename}) by {path}:{line}")


# Options under which a passing session runs no test.
_NO_RUN = ("collectonly", "setuponly", "setupplan", "showfixtures", "show_fixtures_per_test", "forked")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not _primary(config):
        return
    _check_runner("session end")
    quiet = any(config.getoption(o, False) for o in _NO_RUN if hasattr(config.option, o))
    if not _state["worker"] and int(exitstatus) == 0 and not quiet:
        missing = [i.nodeid for i in getattr(session, "items", []) if i.nodeid not in _state["ran"]]
        if missing:
            _note(f"{len(missing)} of {len(session.items)} tests never ran (first: {missing[0]})")
        if _state["failed"]:
            _note(f"{_state['failed']} failures were reported, yet the session would exit 0")
    if os.getppid() != _state["ppid"]:
        _note(f"the process that started pytest (pid {_state['ppid']}) ended while the tests ran")
    if _state["findings"] and os.getpid() == _state["pid"]:
        session.exitstatus = 1
    _state["exitstatus"] = int(session.exitstatus)


def pytest_terminal_summary(terminalreporter):
    if not _primary(terminalreporter.config):
        return
    for msg in _state["findings"]:
        terminalreporter.write_line("tmax-jax verifier guard: " + msg, red=True)


def _exit_as_decided():
    # Registered last, so run first at exit: a failed session ends with its status, whatever exit
    # handler the code under test registered (``atexit.register(os._exit, 0)``).
    status = _state["exitstatus"]
    if status:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)


def pytest_unconfigure(config):
    if not _primary(config) or os.getpid() != _state["pid"]:
        return
    if not _state["worker"]:
        _kill_leftovers()
    _write("finished")
    argv0 = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    is_cli = os.path.basename(argv0) in ("pytest", "py.test") or argv0.endswith(
        os.path.join("pytest", "__main__.py")
    )
    if is_cli and not _state["worker"]:  # a script that called pytest.main() keeps its own exit
        import atexit

        atexit.register(_exit_as_decided)
