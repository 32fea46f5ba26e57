import csv
from pathlib import Path


def expected():
    with open("/app/sales.csv") as f:
        return round(sum(int(r["units"]) * float(r["price"]) for r in csv.DictReader(f)), 2)


def test_revenue_file_exists():
    assert Path("/app/revenue.txt").is_file()


def test_revenue_value():
    assert abs(float(Path("/app/revenue.txt").read_text().strip()) - expected()) < 1e-6
