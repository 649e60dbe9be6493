"""Job traces: the CSV format and its one-line errors, the seeded generator's distributions, and
``stratum cluster`` end to end (bad input exits 2 without a traceback)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from stratum.cli import main
from stratum.cluster.generate import DEVICE_COUNTS, TraceSpec, arrival_rate, generate
from stratum.cluster.trace import format_trace, load_trace, parse_trace
from stratum.errors import StratumError

HEAD = "job,arrival_s,model,batch,steps,devices\n"
HW = """[hardware]
host_bytes = "64GB"
disk_bytes = "1TB"
host_link = { bandwidth = "16GB/s", latency = "10us" }
disk_link = { bandwidth = "2GB/s", latency = "100us" }
intra_node = { bandwidth = BW, latency = "5us" }
inter_node = { bandwidth = "12GB/s", latency = "10us" }

[[hardware.devices]]
name = "gpu"
memory_bytes = "8GB"
speed = 100.0
count = 4
"""


def test_rows_parse_in_arrival_order_with_defaults_and_round_trip():
    jobs = parse_trace(HEAD.strip() + ",priority,max_batch\n# a comment\nb,5,mini,8,10,2,foreground,32\n"
                       "a,1.5,tiny,4,3,1,,\n", models=["tiny", "mini"], devices=4)
    assert [(j.id, j.arrival_s, j.priority, j.batch_limit, j.seq_len, j.work) for j in jobs] == [
        ("a", 1.5, "background", 4, 1024, 12), ("b", 5.0, "foreground", 32, 1024, 80)]
    assert parse_trace(format_trace(jobs), models=["tiny", "mini"], devices=4) == jobs


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("job,arrival_s,model,batch,steps\n", "missing column(s) devices"),
    (HEAD.strip() + ",colour\n", "unknown column(s) colour"),
    (HEAD, "no jobs"),
    (HEAD + "a,0,gpt9,4,1,1\n", "unknown model 'gpt9'"),
    ("job,job,arrival_s,model,batch,steps,devices\na,b,0,tiny,4,1,1\n", "column 'job' appears twice"),
    (HEAD + "a,1e300,tiny,4,1,1\n", "arrival_s = 1e300 is past the simulator's horizon"),
    (HEAD + "a,0,tiny,64,1,16\n", "asks for 16 devices but the cluster has 4"),
    (HEAD + "a,-1,tiny,4,1,1\n", "arrival_s = '-1' is negative"),
    (HEAD + "a,0,tiny,4,-3,1\n", "steps = '-3' is negative"),
    (HEAD + "a,0,tiny,4,0,1\n", "steps must be >= 1"),
    (HEAD + "a,0,tiny,four,1,1\n", "batch = 'four' is not a whole number"),
    (HEAD + "a,0,tiny,2,1,4\n", "needs a sequence per device"),
    (HEAD + "a,0,tiny,4,1,1\na,2,tiny,4,1,1\n", "job 'a' appears twice"),
    (HEAD + "a,0,tiny,4,1,1,9\n", "more fields than the header"),
    (HEAD.strip() + ",priority\na,0,tiny,4,1,1,urgent\n", "neither foreground nor background"),
    (HEAD.strip() + ",max_batch\na,0,tiny,4,1,1,2\n", "max_batch 2 < batch 4"),
])
def test_bad_traces_are_one_line_errors(text, message):
    with pytest.raises(StratumError) as e:
        parse_trace(text, models=["tiny"], devices=4)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_trace_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    text = HEAD + "a,0,tiny,4,1,1\n"
    (tmp_path / "plain.csv").write_text(text, encoding="utf-8")
    (tmp_path / "bom.csv").write_text(text, encoding="utf-8-sig")  # as a spreadsheet saves "CSV UTF-8"
    read = [load_trace(tmp_path / f, models=["tiny"], devices=4) for f in ("plain.csv", "bom.csv")]
    assert read[0] == read[1] and [j.id for j in read[1]] == ["a"]


def test_generator_is_seeded_and_follows_the_philly_sizes():
    spec = TraceSpec(jobs=3000, seed=7, devices=64)
    jobs = generate(spec, lambda j: 60.0)
    assert jobs == generate(spec, lambda j: 60.0) and jobs != generate(TraceSpec(jobs=3000, seed=8, devices=64),
                                                                        lambda j: 60.0)
    share = Counter(j.devices for j in jobs)
    for n, p in DEVICE_COUNTS:
        assert abs(share[n] / len(jobs) - p) < 0.03
    minutes = sorted(j.steps for j in jobs)  # a 60 s step: steps are minutes
    assert 10 ** 1.5 * 0.99 <= minutes[0] and minutes[-1] <= 10 ** 4 * 1.01
    assert abs(sum(m >= 1000 for m in minutes) / len(jobs) - 0.2) < 0.03
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(jobs, jobs[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / arrival_rate(spec), rel=0.1)
    assert all(j.batch == 8 * j.devices and j.max_batch == 4 * j.batch for j in jobs)


def test_a_generated_job_asks_for_at_most_the_devices_that_hold_its_model():
    # the same draws as without the cap (same models, times, arrivals), the big model's jobs on one device
    spec = TraceSpec(jobs=400, seed=3, devices=8, models=("small", "big"))
    free = generate(spec, lambda j: 60.0)
    capped = generate(spec, lambda j: 60.0, holding=lambda model: 1 if model == "big" else 8)
    assert [(j.model, j.arrival_s) for j in capped] == [(j.model, j.arrival_s) for j in free]
    for a, b in zip(free, capped):
        assert b.devices == (1 if a.model == "big" else a.devices) and b.batch == 8 * b.devices
    assert any(j.model == "big" and j.devices > 1 for j in free)


def write_hw(tmp_path, bandwidth: str = '"100GB/s"'):
    p = tmp_path / "hw.toml"
    p.write_text(HW.replace("BW", bandwidth))
    return p


@pytest.mark.parametrize("case, message", [
    ("negative bandwidth", "must be a positive bandwidth"),
    ("unknown model", "unknown model 'gpt9'"),
    ("too big", "asks for 8 devices but the cluster has 4"),
    ("policy", "unknown policy 'fastest'"),
    ("no trace", "cannot read the trace"),
    ("policy twice", "policy 'static-dp' is given twice"),
    ("trace flags", "--seed, --load: options of a generated trace"),
    ("jpg", "must end in .png"),
    ("json a directory", "Is a directory"),
    ("json empty", "no file given for --json"),
    ("past the context", "job 'a' (tiny, seq_len 1024): seq_len 1024 is outside 1..256, tiny's context; set the "
                         "trace's seq_len column"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, case, message):
    hw = write_hw(tmp_path, "-1e9" if case == "negative bandwidth" else '"100GB/s"')
    trace = tmp_path / "jobs.csv"
    row = {"unknown model": "a,0,gpt9,8,1,1", "too big": "a,0,tiny,8,1,8", "past the context": "a,0,tiny,8,1,1"}.get(
        case, "a,0,tiny,8,1,1")
    if case != "no trace":
        trace.write_text(HEAD + row + "\n")
    args = ["cluster", "simulate", "--hardware", str(hw), "--jobs", str(trace)]
    extra = {"policy": ["--policy", "fastest"], "policy twice": ["--policy", "static-dp,burst,static-dp"],
             "trace flags": ["--seed", "1", "--load", "2"], "jpg": ["--png", str(tmp_path / "u.jpg")],
             "json a directory": ["--json", str(tmp_path)], "json empty": ["--json", ""]}
    assert main(args + extra.get(case, [])) == 2
    err = capsys.readouterr().err
    assert err.startswith("stratum: error: ") and message in err and err.count("\n") == 1


def test_cli_simulates_every_policy_and_writes_json_and_png(tmp_path, capsys, cache_dir):
    hw = write_hw(tmp_path)
    trace = tmp_path / "jobs.csv"
    trace.write_text("job,arrival_s,model,batch,steps,devices,priority,max_batch,seq_len\n"
                     "a,0,tiny,8,20,4,foreground,,16\nb,0.001,tiny,4,10,2,background,16,16\n")
    args = ["cluster", "simulate", "--hardware", str(hw), "--jobs", str(trace), "--json", str(tmp_path / "s.json"),
            "--png", str(tmp_path / "u.png"), "--cache-dir", str(cache_dir)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "SIMULATED (cost-model" in out and all(p in out for p in ("static-dp", "burst+multiplex", "elastic"))
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [p["summary"]["policy"] for p in doc["policies"]] == ["static-dp", "burst", "burst+multiplex", "elastic",
                                                                 "elastic-devices"]
    assert all(p["summary"]["completed"] == 2 for p in doc["policies"])
    assert (tmp_path / "u.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("extra, message", [
    ([], "--jobs must be a number of jobs"),
    (["--jobs", "0"], "jobs must be >= 1"),
    (["--jobs", "1000000000"], "1,000,000,000 jobs is more than the 100,000"),
    (["--jobs", "5", "--load", "0"], "load must be a positive number"),
    (["--jobs", "5", "--models", "tiny", "--seq-len", "0"], "seq_len must be >= 1"),
    (["--jobs", "5", "--models", "gpt9"], "model gpt9 at 1024 tokens: unknown model 'gpt9'"),
    (["--jobs", "5", "--models", "tiny"], "model tiny at 1024 tokens: seq_len 1024 is outside 1..256, tiny's "
                                          "context; choose others with --models or --seq-len"),
    (["--jobs", "5", "--policy", "burst", "--png", "x.png"], "--policy, --png: options of stratum cluster "
                                                             "simulate; trace only writes the jobs"),
    (["--jobs", "5", "--amplification", "2"], "--amplification: options of stratum cluster simulate"),
])
def test_cli_trace_bad_input_exits_2(tmp_path, capsys, extra, message):
    args = ["cluster", "trace", "--hardware", str(write_hw(tmp_path)), "--out", str(tmp_path / "t.csv")]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "t.csv").exists()


def test_cli_trace_draws_the_models_asked_for(tmp_path, cache_dir):
    out = tmp_path / "t.csv"
    assert main(["cluster", "trace", "--hardware", str(write_hw(tmp_path)), "--out", str(out), "--jobs", "6",
                 "--models", "tiny", "--seq-len", "16", "--cache-dir", str(cache_dir)]) == 0
    rows = out.read_text().splitlines()[1:]
    assert len(rows) == 6 and all(r.split(",")[2] == "tiny" and r.split(",")[-1] == "16" for r in rows)
