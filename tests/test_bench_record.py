"""attnpool.bench.record: a bench script's JSON and Markdown under one dated name."""

import datetime
import json
import os

from attnpool.bench.record import write_record


def test_a_record_is_its_json_and_markdown_under_todays_name(tmp_path):
    out = tmp_path / "results" / "new"  # made where missing
    before = datetime.date.today()
    stem = write_record(str(out), "cpu-plan", {"rows": [1, 2]}, ["# Title", "", "| a |"])
    # (a run across midnight may name either day)
    assert os.path.dirname(stem) == str(out)
    assert os.path.basename(stem) in {f"{day}-cpu-plan" for day in (before, datetime.date.today())}
    assert json.loads(open(stem + ".json").read()) == {"rows": [1, 2]}
    assert open(stem + ".md").read() == "# Title\n\n| a |\n"
    # Markdown given as text is written as it is
    again = write_record(str(out), "cpu-plan", {}, "# Again\n")
    assert open(again + ".md").read() == "# Again\n"
