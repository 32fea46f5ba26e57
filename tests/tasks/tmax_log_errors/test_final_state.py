from pathlib import Path

LOGS = Path("/home/user/logs")


def expected():
    lines = []
    for p in sorted(LOGS.glob("*.log")):
        lines.append(f"{p.name}: {sum('ERROR' in line for line in p.read_text().splitlines())}")
    return "\n".join(lines)


def test_report_matches():
    report = Path("/home/user/error_report.txt")
    assert report.is_file(), "report missing"
    assert report.read_text().strip() == expected()


def test_logs_untouched():
    assert (LOGS / "db.log").read_text().count("ERROR") == 3
