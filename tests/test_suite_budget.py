"""The time budget (tests/suite_budget.py), tried on real pytest runs of a small suite made
here: a file that got slower fails naming itself, by working or by waiting; the same file
on a machine made busy by other processes does not; the README's figure is the record's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import suite_budget

TESTS = Path(__file__).resolve().parent
BUSY_PROCESSES = 6  # on 2 cores: each process gets under a third of a core
WORK_S = 0.5  # CPU-seconds the small suite's file works on a quiet machine
SLACK = ["--budget-slack", "0.5", "--budget-sample-every", "0.1"]


def _suite(root: Path, body: str) -> None:
    (root / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\npytest_plugins = ['suite_budget']\n"
    )
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = .\n")
    (root / "test_work.py").write_text(
        "import time\n\n"
        "def _work(seconds):\n"
        "    end = time.process_time() + seconds\n"
        "    while time.process_time() < end:\n"
        "        pass\n\n"
        f"def test_work():\n    {body}\n"
    )


def _run(root: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", *options],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
    )


def _recorded(root: Path, body: str) -> Path:
    """A small suite whose one file runs ``body``, run once and recorded."""
    _suite(root, body)
    proc = _run(root, "--budget-out", "record.json", *SLACK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((root / "record.json").read_text())
    assert record["suite"]["complete"] and record["files"]["test_work.py"]["tests"] == 1
    return root


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """The file working WORK_S, recorded; judged again as it is, within its budget."""
    root = _recorded(tmp_path_factory.mktemp("recorded"), f"_work({WORK_S})")
    record = json.loads((root / "record.json").read_text())
    assert record["files"]["test_work.py"]["cpu_s"] >= WORK_S
    proc = _judged(root)
    assert proc.returncode == 0 and "1 files within budget" in proc.stdout, proc.stdout
    return root


@pytest.fixture
def recorded(recording, tmp_path):
    return Path(shutil.copytree(recording, tmp_path / "suite"))


def _judged(root: Path, *options: str) -> subprocess.CompletedProcess:
    judged = ["--budget", "--budget-record", "record.json", "--budget-out", "run.json"]
    return _run(root, *judged, *SLACK, *options)


def test_a_file_that_works_more_fails_naming_itself(recorded):
    """Five times the work: its CPU-seconds say so whatever the machine's load. (At the
    recorded CPU speed: the calibration of two runs a second apart can differ by half on a
    shared machine, which the speed ratio's own test covers.) The first test's CPU-seconds
    include the collection's, which varies between runs on a busy machine: at three times
    the work (against the record's 1.3 times plus 0.5 s) a CI run at a load ratio of 1.86
    let the file pass."""
    _suite(recorded, f"_work({5 * WORK_S})")
    proc = _judged(recorded, "--budget-speed-ratio", "1")
    assert proc.returncode == 1, proc.stdout
    assert "OVER BUDGET test_work.py:" in proc.stdout and "1 passed" in proc.stdout


def test_a_file_that_waits_longer_fails_naming_itself(tmp_path):
    """Five times the waiting: its CPU-seconds do not show it, its wall time does, judged
    at the recorded load and speed (``--budget-load-ratio 1``: the suite's other tests load
    the machine as they please; the ratio's own measure is tried beside busy processes
    below)."""
    root = _recorded(tmp_path, f"time.sleep({WORK_S})")
    _suite(root, f"time.sleep({5 * WORK_S})")
    proc = _judged(root, "--budget-load-ratio", "1", "--budget-speed-ratio", "1")
    assert proc.returncode == 1, proc.stdout
    assert "OVER BUDGET test_work.py:" in proc.stdout and "load ratio 1.00" in proc.stdout


def test_a_busy_machine_does_not_turn_a_file_red(recorded):
    """The same file while other processes keep the cores busy, against a record of a quiet
    machine: not over budget, and the sampler saw the load. (The record's contention is set
    to a quiet machine's, 1: measured here, it would be whatever the suite's other worker
    was running at that moment.)"""
    record_file = recorded / "record.json"
    record = json.loads(record_file.read_text())
    for entry in [record["suite"], *record["files"].values()]:
        entry["contention"] = 1.0
    record_file.write_text(json.dumps(record))
    spin = "import time\nwhile True:\n    pass\n"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(BUSY_PROCESSES)]
    try:
        time.sleep(0.2)
        proc = _judged(recorded)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert proc.returncode == 0, proc.stdout
    run = json.loads((recorded / "run.json").read_text())
    # the spinners alone are runnable processes beyond the sampler's own CPU
    assert run["suite"]["contention"] >= BUSY_PROCESSES / os.cpu_count(), run


def test_a_partial_run_judges_no_suite_and_records_nothing(recorded):
    proc = _run(recorded, "--budget", "--budget-record", "record.json", "-k", "work", *SLACK)
    assert proc.returncode == 0 and "judged only on a whole run" in proc.stdout
    out = recorded / "record.json"
    with pytest.raises(SystemExit, match="not a full run"):
        suite_budget.record_last_run(
            last=_partial(recorded), record=out, readme=recorded / "README.md"
        )


def _partial(root: Path) -> Path:
    run = json.loads((root / "record.json").read_text())
    run["suite"]["complete"] = False
    path = root / "partial.json"
    path.write_text(json.dumps(run))
    return path


def test_verdicts_follow_the_rule():
    """Over by CPU-seconds at any load; by scaled wall time where the machine was no busier
    than at the record."""
    recorded = {"wall_s": 100.0, "cpu_s": 80.0}
    quiet, busy = 1.0, 2.0
    run = suite_budget.FileRun(wall_s=170.0, cpu_s=80.0)  # waited longer
    assert suite_budget.judge_file("f", run, recorded, quiet).over  # 170 > 1.3 x 100 + 30
    assert not suite_budget.judge_file("f", run, recorded, busy).over  # the load, maybe
    run = suite_budget.FileRun(wall_s=150.0, cpu_s=80.0)  # within the wall time's slack
    assert not suite_budget.judge_file("f", run, recorded, quiet).over
    run = suite_budget.FileRun(wall_s=300.0, cpu_s=80.0)  # busy, CPU as recorded: load
    assert not suite_budget.judge_file("f", run, recorded, busy).over
    run = suite_budget.FileRun(wall_s=110.0, cpu_s=160.0)  # it works twice as much
    assert suite_budget.judge_file("f", run, recorded, busy).over
    assert suite_budget.judge_file("f", run, recorded, quiet).over
    run = suite_budget.FileRun(wall_s=100.0, cpu_s=80.0)  # as recorded, on a quieter machine
    assert not suite_budget.judge_file("f", run, recorded, 0.5).over


def test_a_slower_cpu_divides_both_times():
    """A CPU that runs the calibration twice as slowly takes twice the wall time and
    CPU-seconds for the same work: not over; the same file working three times as much on it
    still is."""
    recorded = {"wall_s": 100.0, "cpu_s": 80.0}
    slower = suite_budget.speed_ratio(now=0.2, recorded=0.1)
    assert slower == 2.0
    run = suite_budget.FileRun(wall_s=200.0, cpu_s=160.0)
    assert suite_budget.judge_file("f", run, recorded, 1.0).over  # without the speed
    assert not suite_budget.judge_file("f", run, recorded, 1.0, speed=slower).over
    run = suite_budget.FileRun(wall_s=600.0, cpu_s=480.0)
    assert suite_budget.judge_file("f", run, recorded, 1.0, speed=slower).over
    assert suite_budget.speed_ratio(None, 0.1) == suite_budget.speed_ratio(0.1, None) == 1.0
    assert suite_budget.speed_ratio(10.0, 0.1) == suite_budget.SPEED_LIMITS[1]
    assert suite_budget.speed_ratio(0.05, 0.1) == 1.0  # faster: its waits do not shrink


def test_the_suite_line_names_the_speed_ratio(recorded):
    proc = _judged(recorded, "--budget-speed-ratio", "2")
    assert proc.returncode == 0, proc.stdout
    assert "speed ratio 2.00" in proc.stdout, proc.stdout
    run = json.loads((recorded / "run.json").read_text())
    assert run["suite"]["calibration_s"] > 0


def test_the_readme_states_the_recorded_figure():
    """The README's sentence on the suite is generated from tests/durations.json
    (``make test-record``), not written by hand."""
    record = suite_budget.load_record()
    readme = suite_budget.README.read_text()
    assert suite_budget.readme_with_figure(readme, record) == readme
    assert record["suite"]["complete"] and record["suite"]["wall_s"] < suite_budget.SUITE_BUDGET_S


def test_the_record_takes_each_file_at_its_slowest_run():
    """Per file the largest wall time (with its run's load) and CPU-seconds of the runs of
    the same tests; a file whose tests changed keeps the last run's."""

    def run(**files):
        entries = {
            name: {"wall_s": w, "cpu_s": c, "tests": t, "contention": k}
            for name, (w, c, t, k) in files.items()
        }
        return {"suite": {"wall_s": 1.0}, "files": entries}

    last = run(a=(10.0, 9.0, 3, 1.0), b=(20.0, 5.0, 2, 2.0), c=(7.0, 7.0, 4, 1.0))
    earlier = run(a=(12.0, 8.0, 3, 3.0), b=(15.0, 6.0, 2, 1.0), c=(99.0, 99.0, 5, 1.0))
    files = suite_budget.slowest_per_file(last, [earlier])["files"]
    assert files["a"] == {"wall_s": 12.0, "cpu_s": 9.0, "tests": 3, "contention": 3.0}
    assert files["b"] == {"wall_s": 20.0, "cpu_s": 6.0, "tests": 2, "contention": 2.0}
    assert files["c"] == last["files"]["c"]


def test_a_quieter_machine_does_not_scale_a_time_up():
    """Files and the suite alike: a busier machine divides the wall time by its load ratio,
    a quieter one leaves it as it was (its measure is noisy), a slower CPU divides it."""
    assert suite_budget.normalised_seconds(1170.0, 0.9, 1.0) == 1170.0
    assert suite_budget.normalised_seconds(1200.0, 2.0, 1.0) == 600.0
    assert suite_budget.normalised_seconds(1200.0, 0.5, 2.0) == 600.0
