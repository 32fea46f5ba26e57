"""Resume bookkeeping of an evaluation run and its summary numbers."""

import json
import re
from html.parser import HTMLParser

import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.eval.html_report import render_before_after_html, render_html
from tmax_jax.eval.passk import pass_at_k
from tmax_jax.eval.results import AttemptRecord, ResultsLog, check_run_identity
from tmax_jax.eval.summary import report_ks, summarize


def test_log_survives_reload_and_marks_done(tmp_path):
    log = ResultsLog(tmp_path)
    log.add(AttemptRecord("a", 0, "passed", reward=1.0))
    log.add(AttemptRecord("a", 1, "error", reason="sandbox died"))
    log.add(AttemptRecord("b", 0, "env_unavailable", reason="pip install"))
    again = ResultsLog(tmp_path)
    assert len(again) == 3
    assert again.is_done("a", 0) and again.is_done("a", 1) and again.is_done("b", 0)
    assert not again.is_done("a", 2) and not again.is_done("c", 0)
    retry = ResultsLog(tmp_path, retry_errors=True)
    assert not retry.is_done("a", 1) and retry.is_done("a", 0)
    retry.add(AttemptRecord("a", 1, "failed"))
    assert {r.key: r.status for r in ResultsLog(tmp_path).records()}[("a", 1)] == "failed"


def test_torn_last_line_is_rerun_but_corruption_elsewhere_is_an_error(tmp_path):
    log = ResultsLog(tmp_path)
    log.add(AttemptRecord("a", 0, "passed", reward=1.0))
    with open(log.path, "a") as f:
        f.write('{"task_id": "a", "attem')
    reloaded = ResultsLog(tmp_path)
    assert reloaded.is_done("a", 0) and not reloaded.is_done("a", 1)
    # The torn line is gone, so the next append is a line of its own.
    reloaded.add(AttemptRecord("a", 1, "failed"))
    assert [json.loads(line)["attempt"] for line in log.path.read_text().splitlines()] == [0, 1]
    lines = log.path.read_text().splitlines()
    log.path.write_text(lines[0] + "\n{garbage\n" + lines[1] + "\n")
    with pytest.raises(ConfigError, match="line 2"):
        ResultsLog(tmp_path)


def test_bad_status_is_named():
    with pytest.raises(ConfigError, match="'win'"):
        AttemptRecord("a", 0, "win")


def test_run_identity_refuses_another_agent(tmp_path):
    check_run_identity(tmp_path, {"agent": "oracle", "tasks_dir": "/t"})
    check_run_identity(tmp_path, {"agent": "oracle", "tasks_dir": "/t"})
    with pytest.raises(ConfigError, match="agent: saved 'oracle', now 'noop'"):
        check_run_identity(tmp_path, {"agent": "noop", "tasks_dir": "/t"})


def test_report_ks():
    assert report_ks(1) == [1]
    assert report_ks(5) == [1, 2, 4, 5]
    assert report_ks(8) == [1, 2, 4, 8]


def _records():
    recs = []
    # t1: 2 of 4 pass, t2: 0 of 4, t3: 4 of 4, t4: environment unavailable, t5: never run.
    for i, ok in enumerate([True, False, True, False]):
        recs.append(AttemptRecord("t1", i, "passed" if ok else "failed", reward=float(ok), category="files"))
    for i in range(4):
        recs.append(AttemptRecord("t2", i, "error" if i == 0 else "failed", reward=0.25, category="files"))
    for i in range(4):
        recs.append(AttemptRecord("t3", i, "passed", reward=1.0, category="net"))
    recs.append(AttemptRecord("t4", 0, "env_unavailable", reason="apt-get", category="net"))
    return recs


def test_summary_numbers_match_a_hand_computation():
    tasks = {"t1": "files", "t2": "files", "t3": "net", "t4": "net", "t5": "net"}
    s = summarize(_records(), tasks, k=4, meta={"agent": "oracle"})
    assert s["agent"] == "oracle" and s["ks"] == [1, 2, 4]
    o = s["overall"]
    assert (o["tasks"], o["evaluated"], o["env_unavailable"], o["not_run"]) == (5, 3, 1, 1)
    assert o["pass_at"]["1"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert o["pass_at"]["2"] == pytest.approx((pass_at_k(4, 2, 2) + 0 + 1) / 3)
    assert o["pass_at"]["4"] == pytest.approx(2 / 3)
    assert o["errors"] == 1 and o["zero_pass"] == 1 and o["solved_any"] == 2
    assert o["mean_reward"] == pytest.approx((0.5 + 0.25 + 1.0) / 3)
    files, net = s["categories"]["files"], s["categories"]["net"]
    assert files["pass_at"]["1"] == pytest.approx(0.25)
    assert net["pass_at"]["4"] == pytest.approx(1.0) and net["env_unavailable"] == 1
    assert s["env_unavailable"] == [{"task_id": "t4", "reason": "apt-get"}]
    rows = {r["task_id"]: r for r in s["tasks"]}
    assert rows["t5"]["status"] == "not_run" and rows["t4"]["pass_at"]["1"] is None


def _tables(page: str) -> list[list[str]]:
    """The header cells of each table of an HTML page, read with the standard library's parser."""

    class Headers(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables, self._in_th = [], False

        def handle_starttag(self, tag, attrs):
            if tag == "table":
                self.tables.append([])
            if tag == "th":
                self.tables[-1].append("")
                self._in_th = True

        def handle_endtag(self, tag):
            if tag == "th":
                self._in_th = False

        def handle_data(self, data):
            if self._in_th:
                self.tables[-1][-1] += data

    parser = Headers()
    parser.feed(page)
    return parser.tables


def test_html_report_has_tables_charts_and_escapes():
    recs = _records() + [AttemptRecord("<script>", 0, "passed", reward=1.0, category="a&b")]
    tasks = {"t1": "files", "t2": "files", "t3": "net", "t4": "net", "<script>": "a&b"}
    page = render_html(summarize(recs, tasks, k=4, meta={"agent": "oracle"}))
    assert page.count("<svg") == 2
    assert "<script>" not in page and "&lt;script&gt;" in page and "a&amp;b" in page
    assert "environment unavailable" in page and "pass@4" in page
    overall, per_category, task_table = _tables(page)
    assert (
        overall
        == per_category
        == ["", "tasks", "evaluated", "env unavailable", "invalid"]
        + [
            "pass@1",
            "pass@2",
            "pass@4",
            "mean reward",
            "errors",
        ]
    )
    assert task_table == ["task", "category", "status", "passed", "pass@1", "pass@4", "mean reward", "note"]
    # The per-category chart: one bar per category and pass@j, the a&b category's pass@4 drawn as
    # n/a (one attempt only), the others with their values.
    chart = page[page.index("<svg", page.index("<svg") + 1) : page.rindex("</svg>")]
    assert ">pass@1</text>" in chart and ">pass@4</text>" in chart and ">n/a</text>" in chart
    assert re.findall(r">(\d\.\d{3}|n/a)</text>", chart) == [
        "1.000",
        "0.250",
        "1.000",
        "n/a",
        "0.500",
        "1.000",
    ]


def test_html_report_at_k1_shows_pass_at_1_once():
    page = render_html(summarize(_records(), {"t1": "files", "t3": "net"}, k=1, meta={"agent": "a"}))
    for header in _tables(page):
        assert header.count("pass@1") == 1, header
    assert _tables(page)[-1] == ["task", "category", "status", "passed", "pass@1", "mean reward", "note"]
    assert page.count(">pass@1</text>") == 0  # one series per chart: no legend to repeat it in
    assert "pass@1 per category" in page


def test_before_after_report_charts_every_family():
    summary = {
        "run_dir": "runs/x",
        "steps": 3,
        "samples_per_task": 2,
        "pass_rate_before": 0.25,
        "pass_rate_after": 0.5,
        "heldout_tasks": 4,
        "pass_rate_by_family": {
            "largest_number": {"before": 0.0, "after": 0.5, "tasks": 2},
            "write_word": {"before": 0.5, "after": None, "tasks": 2},
        },
        "pass_rate_by_axis": {"domain": {"text": {"before": 0.25, "after": 0.5, "tasks": 4}}},
    }
    page = render_before_after_html(summary)
    assert page.count("<svg") == 1 and 'src="learning_curve.png"' in page
    chart = page[page.index("<svg") : page.index("</svg>")]
    for name in ("all", "largest_number", "write_word", "before", "after"):
        assert f">{name}</text>" in chart, name
    assert re.findall(r">(\d\.\d{3}|n/a)</text>", chart) == [
        "0.250",
        "0.000",
        "0.500",
        "0.500",
        "0.500",
        "n/a",
    ]
