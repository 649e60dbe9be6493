"""The makespan line a sweep prints at its end and `stratum sweep status` prints any time, from makespan.json."""

from __future__ import annotations

from stratum.sweep.results import MAKESPAN_FILE, makespan_line, read_makespan


def test_the_makespan_line_says_what_is_known(tmp_path):
    assert read_makespan(tmp_path) is None
    (tmp_path / MAKESPAN_FILE).write_text("{not json")
    assert read_makespan(tmp_path) is None
    (tmp_path / MAKESPAN_FILE).write_text('{"scheduler": "lrtf", "measured_s": null, "predicted_s": 20.0}')
    doc = read_makespan(tmp_path)
    assert doc is not None
    assert makespan_line(doc) == "makespan: not measured yet (the sweep has not ended), 20.0 s predicted (SIMULATED)"
    assert makespan_line({**doc, "measured_s": 23.0}) == (
        "makespan: 23.0 s measured, 20.0 s predicted (SIMULATED): measured / predicted 1.15")
    assert makespan_line({"scheduler": "fifo", "measured_s": 9.25}) == "makespan: 9.2 s measured"
