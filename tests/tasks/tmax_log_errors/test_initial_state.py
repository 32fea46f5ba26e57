from pathlib import Path

LOGS = Path("/home/user/logs")


def test_logs_present():
    assert sorted(p.name for p in LOGS.glob("*.log")) == ["app.log", "auth.log", "db.log"]


def test_no_report_yet():
    assert not Path("/home/user/error_report.txt").exists()
