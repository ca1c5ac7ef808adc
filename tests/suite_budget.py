"""The suite's time budget (docs/testing.md, "The time budget").

Every run records each test file's time in ``.cache/test-durations/last.json`` (and a run of
the whole suite in ``last-full.json`` too): its wall
time (setup, call and teardown of its tests, module fixtures included), its CPU-seconds
(the pytest process and the children it waited for: torchrun and its ranks) and how loaded
the machine was meanwhile. ``make test`` (``--budget``) judges that run against the record
committed in ``tests/durations.json``:

* a file fails when it takes more than ``GROWTH`` times its recorded time plus ``SLACK_S``
  (CPU-seconds) or twice that slack (wall time);
* the whole suite fails when it takes more than ``SUITE_BUDGET_S``.

Times are judged with the load and the CPU's speed taken out, so that a busy or slower
machine cannot turn a run red while a file that got twice as slow still fails. The speed: a
fixed pure-Python workload's CPU time (the best of several: other processes' load barely
changes it), taken as the run starts; where the CPU runs it k times slower than at the
record (another machine), every time is divided by k (CPU-seconds too: they grow with a
slower CPU); a faster CPU is judged as the record's. A small sampler process reads the number
of runnable processes (``/proc/loadavg``) once a second for the whole run: its contention,
max(1, runnable others / CPUs), is how much slower than alone a CPU-bound process runs. A
file's *load ratio* is the mean contention during the file's run over the mean during the
same file's recorded run (which cancels the suite's own load: its multi-process tests
share the cores), and its wall time is divided by it. Where the ratio says the machine was
busy (> ``BUSY``), only CPU-seconds can fail a file: they barely change with load, a wall
time scaled by an estimate of it may; a file fails on either when it grew in CPU-seconds,
and on its wall time when the machine was no busier than at its record. (Timing a small workload
instead does not see the load: a process that sleeps between samples is scheduled at once
when it wakes.)

The suite's own waits for processes (a run to reach a step, a job to end) are hang guards:
``patient(seconds)`` stretches them by the contention the run started under against the
record's, so that a busy machine does not turn them into failures.

``python tests/suite_budget.py record [EARLIER.json ...]`` makes the last full run the record
(each file at the slowest of it and the earlier full runs given) and rewrites the README's
figure from it (``make test-record``); ``python tests/suite_budget.py ci
SECONDS`` judges a whole CI run (install, checks, tests) against ``CI_BUDGET_S``.
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
RECORD = Path(__file__).with_name("durations.json")
LAST_RUN = REPO / ".cache" / "test-durations" / "last.json"
LAST_FULL_RUN = LAST_RUN.with_name("last-full.json")  # the last whole suite: what is recorded
README = REPO / "README.md"

SUITE_BUDGET_S = 20 * 60  # `make test` on an idle 2-core machine
CI_BUDGET_S = 28 * 60  # `.ci/run`: install, `make check`, `make test`
GROWTH = 1.3  # a file may grow by 30% over its record ...
SLACK_S = 15.0  # ... plus this, before it fails (CPU-seconds) ...
# ... or twice this (wall time: it carries the other worker's load, which the sampler only
# estimates; a file waiting twice as long still fails past ~45 s)
WALL_SLACK_FACTOR = 2.0
BUSY = 1.2  # a load ratio above this is a busy machine: wall time alone cannot fail a file
UNKNOWN_FILE_S = 60.0  # where a file without a record is placed in the longest-first order
# A speed ratio is clamped to these: a faster CPU than the record's is not scaled up (the
# suite's waits do not shrink with it), and beyond 3x the measure has gone wrong.
SPEED_LIMITS = (1.0, 3.0)

# The sampler: the number of runnable processes, once a second.
SAMPLE_EVERY_S = 1.0
_CONTENTION = """
import os
def contention():
    running = int(open("/proc/loadavg").read().split()[3].split("/")[0])
    return max(1.0, (running - 1) / os.cpu_count())  # the others, not this reader
"""
_SAMPLER = (
    _CONTENTION
    + """
import sys, time
out, every = open(sys.argv[1], "a", buffering=1), float(sys.argv[2])
while True:
    out.write(f"{time.time():.3f} {contention():.3f}\\n")
    time.sleep(every)
"""
)
LOAD_VARIABLE = "T2TRAIN_TEST_LOAD"  # the start's load ratio, for the pytest workers


def _contention_now(samples: int = 5) -> float:
    """The mean contention over half a second, here and now."""
    namespace: dict = {}
    exec(_CONTENTION, namespace)
    values = []
    for _ in range(samples):
        values.append(namespace["contention"]())
        time.sleep(0.1)
    return statistics.mean(values)


def calibration_seconds(repeats: int = 7, steps: int = 1_000_000) -> float:
    """The CPU time of a fixed pure-Python workload, the best of ``repeats`` (CPU time: the
    waits of a loaded machine are not in it; the best: nor are cache misses after a switch)."""
    best = float("inf")
    for _ in range(repeats):
        started, total = time.process_time(), 0
        for i in range(steps):
            total += i * i % 7
        best = min(best, time.process_time() - started)
    return best


def speed_ratio(now: Optional[float], recorded: Optional[float]) -> float:
    """How much slower this CPU ran the calibration than the record's (1 where either is
    unknown)."""
    if not now or not recorded:
        return 1.0
    return min(max(now / recorded, SPEED_LIMITS[0]), SPEED_LIMITS[1])


def patient(seconds: float) -> float:
    """``seconds`` of a hang guard, stretched by the load the run started under (1x to 4x)."""
    return seconds * min(max(float(os.environ.get(LOAD_VARIABLE, "1")), 1.0), 4.0)


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it waited for (torchrun, its ranks)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def load_record(path: Path = RECORD) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"files": {}}


def longest_first(files: list[str], record: dict) -> list[str]:
    """``files`` (paths relative to the repository), longest recorded first; a file without
    a record is placed as if it took ``UNKNOWN_FILE_S``."""
    recorded = record.get("files", {})
    return sorted(files, key=lambda f: -recorded.get(f, {}).get("wall_s", UNKNOWN_FILE_S))


# ----------------------------------------------------------------------------- judging


@dataclass
class FileRun:
    wall_s: float = 0.0
    cpu_s: float = 0.0
    start: float = float("inf")
    stop: float = 0.0
    tests: int = 0


@dataclass
class Verdict:
    file: str
    wall_s: float
    normalised_s: float
    limit_s: float
    load_ratio: float
    cpu_s: float
    cpu_limit_s: float
    slack_s: float
    speed: float = 1.0  # how much slower the CPU than at the record; divides both times

    @property
    def over(self) -> bool:
        """Over its limit: by its CPU-seconds, which load barely changes; or, where the
        machine was no busier than when recorded, by its wall time scaled by the load (a
        file that got slower waiting, which its CPU-seconds do not show)."""
        if self.cpu_s / self.speed > self.cpu_limit_s:
            return True
        return self.load_ratio <= BUSY and self.normalised_s > self.limit_s

    def line(self) -> str:
        return (
            f"{self.file}: {self.wall_s:.0f} s ({self.normalised_s:.0f} s at the recorded load "
            f"and speed, load ratio {self.load_ratio:.2f}, speed ratio {self.speed:.2f}; "
            f"{self.cpu_s:.0f} CPU-s) against its limit of {self.limit_s:.0f} s ({GROWTH}x its "
            f"recorded time + {WALL_SLACK_FACTOR * self.slack_s:g} s; CPU limit "
            f"{self.cpu_limit_s:.0f} s, {GROWTH}x + {self.slack_s:g} s)"
        )


def normalised_seconds(wall_s: float, load_ratio: float, speed: float) -> float:
    """A wall time at the recorded load and CPU speed. A quieter machine than at the record
    is not scaled up: the contention measure is noisy (a file recorded beside the suite's
    multi-process tests, run now beside single-process ones, read as twice as quiet and its
    wall time as doubled; a whole suite at a ratio of 0.90, 19.5 min, as 20.3)."""
    return wall_s / max(load_ratio, 1.0) / speed


def judge_file(
    name: str,
    run: FileRun,
    recorded: dict,
    load_ratio: float,
    slack_s: float = SLACK_S,
    speed: float = 1.0,
) -> Verdict:
    return Verdict(
        file=name,
        wall_s=run.wall_s,
        normalised_s=normalised_seconds(run.wall_s, load_ratio, speed),
        limit_s=GROWTH * recorded["wall_s"] + WALL_SLACK_FACTOR * slack_s,
        load_ratio=load_ratio,
        cpu_s=run.cpu_s,
        cpu_limit_s=GROWTH * recorded["cpu_s"] + slack_s,
        slack_s=slack_s,
        speed=speed,
    )


def mean_in(samples: list[tuple[float, float]], start: float, stop: float) -> Optional[float]:
    """The mean contention sampled between ``start`` and ``stop``; None under 2 samples."""
    inside = [value for t, value in samples if start <= t <= stop]
    return statistics.mean(inside) if len(inside) >= 2 else None


def load_ratio(
    samples: list[tuple[float, float]], start: float, stop: float, recorded: Optional[float], run
) -> float:
    """How much slower the machine was during [start, stop] than during the recorded run of
    the same tests; the whole run's ratio ``run`` where either side has too few samples."""
    now = mean_in(samples, start, stop)
    if now is None or not recorded:
        return run
    return min(max(now / recorded, 0.5), 10.0)


# ------------------------------------------------------------------------------ plugin


def pytest_addoption(parser):
    group = parser.getgroup("budget", "the suite's time budget (tests/suite_budget.py)")
    group.addoption(
        "--budget",
        action="store_true",
        help="fail the run when a whole test file or the whole suite is over its time budget",
    )
    group.addoption(
        "--budget-record",
        default=str(RECORD),
        help="the record to judge against and to order files by (default: %(default)s)",
    )
    group.addoption(
        "--budget-slack",
        type=float,
        default=SLACK_S,
        help="seconds a file may grow beyond its 30%% (default: %(default)s)",
    )
    group.addoption("--budget-sample-every", type=float, default=SAMPLE_EVERY_S, help="seconds")
    group.addoption(
        "--budget-load-ratio",
        type=float,
        help="judge with this load ratio instead of the sampler's (tests of the budget)",
    )
    group.addoption(
        "--budget-speed-ratio",
        type=float,
        help="judge with this CPU speed ratio instead of the calibration's (tests of the budget)",
    )
    group.addoption(
        "--budget-out",
        default=str(LAST_RUN),
        help="where this run's durations are written (default: %(default)s)",
    )


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


class _WorkerClock:
    """In the process that runs the tests: each report carries its phase's CPU-seconds."""

    def __init__(self):
        self.last = _cpu_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        now = _cpu_seconds()
        report.user_properties = [*report.user_properties, ("budget_cpu_s", now - self.last)]
        self.last = now


class _Budget:
    """In the controlling process: collects the reports, runs the sampler, judges."""

    def __init__(self, config):
        self.config = config
        self.record = load_record(Path(config.getoption("budget_record")))
        self.calibration_s = calibration_seconds()  # before the workers load the machine
        self.speed = config.getoption("budget_speed_ratio") or speed_ratio(
            self.calibration_s, self.record.get("suite", {}).get("calibration_s")
        )
        self.start_contention = _contention_now()
        recorded_start = self.record.get("suite", {}).get("start_contention")
        if recorded_start:  # inherited by the pytest workers
            os.environ[LOAD_VARIABLE] = f"{self.start_contention / recorded_start:.2f}"
        self.files: dict[str, FileRun] = {}
        self.seen: set[str] = set()
        self.collected: dict[str, int] = {}
        self.started = time.time()
        every = config.getoption("budget_sample_every")
        self.slack = config.getoption("budget_slack")
        self.samples_path = Path(tempfile.mkstemp(prefix="t2train-load-", suffix=".txt")[1])
        self.sampler = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, str(self.samples_path), str(every)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        self.fixed_ratio = config.getoption("budget_load_ratio")
        self.verdicts: list[Verdict] = []
        self.suite_line = ""
        self.suite_over = False
        self.out = Path(config.getoption("budget_out"))

    def pytest_collection_finish(self, session):
        counts: dict[str, int] = {}
        for item in session.items:
            name = item.nodeid.split("::")[0]
            counts[name] = counts.get(name, 0) + 1
        self.collected = counts

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        counts: dict[str, int] = {}
        for nodeid in ids:
            name = nodeid.split("::")[0]
            counts[name] = counts.get(name, 0) + 1
        self.collected = counts

    def pytest_runtest_logreport(self, report):
        run = self.files.setdefault(report.nodeid.split("::")[0], FileRun())
        run.wall_s += report.duration
        run.cpu_s += dict(report.user_properties).get("budget_cpu_s", 0.0)
        run.start = min(run.start, report.start)
        run.stop = max(run.stop, report.stop)
        if report.nodeid not in self.seen:
            self.seen.add(report.nodeid)
            run.tests += 1

    def _samples(self) -> list[tuple[float, float]]:
        self.sampler.terminate()
        self.sampler.wait()
        text = self.samples_path.read_text()
        self.samples_path.unlink(missing_ok=True)
        return [(float(t), float(dt)) for t, dt in (line.split() for line in text.splitlines())]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        samples = self._samples()
        elapsed = time.time() - self.started
        run_mean = statistics.mean(value for _, value in samples) if samples else None
        recorded_files = self.record.get("files", {})
        recorded_suite = self.record.get("suite", {})
        run_ratio = load_ratio(samples, 0, float("inf"), recorded_suite.get("contention"), 1.0)
        complete = {
            name: run
            for name, run in self.files.items()
            if run.tests == self.collected.get(name, -1)
        }
        whole = _whole_suite(self.config) and len(complete) == len(self.collected) > 0
        result = {
            "suite": {
                "wall_s": round(elapsed, 1),
                "tests": len(self.seen),
                "contention": run_mean,
                "start_contention": self.start_contention,
                "calibration_s": self.calibration_s,
                "complete": whole,
                "date": time.strftime("%Y-%m-%d"),
            },
            "files": {
                name: {
                    "wall_s": round(run.wall_s, 2),
                    "cpu_s": round(run.cpu_s, 2),
                    "tests": run.tests,
                    "contention": mean_in(samples, run.start, run.stop),
                }
                for name, run in sorted(complete.items(), key=lambda kv: -kv[1].wall_s)
            },
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(result, indent=1) + "\n")
        if whole:  # a partial run since does not replace it
            self.out.with_name(LAST_FULL_RUN.name).write_text(json.dumps(result, indent=1) + "\n")
        if not self.config.getoption("budget"):
            return
        for name, run in complete.items():
            if recorded_files.get(name, {}).get("tests") == run.tests:
                ratio = self.fixed_ratio or load_ratio(
                    samples, run.start, run.stop, recorded_files[name].get("contention"), run_ratio
                )
                self.verdicts.append(
                    judge_file(name, run, recorded_files[name], ratio, self.slack, self.speed)
                )
        if whole:
            run_ratio = self.fixed_ratio or run_ratio
            normalised = normalised_seconds(elapsed, run_ratio, self.speed)
            self.suite_over = normalised > SUITE_BUDGET_S
            self.suite_line = (
                f"the suite took {elapsed / 60:.1f} min ({normalised / 60:.1f} min at the "
                f"recorded load and speed, load ratio {run_ratio:.2f}, speed ratio "
                f"{self.speed:.2f}) against its budget of {SUITE_BUDGET_S / 60:.0f} min"
            )
        over = any(v.over for v in self.verdicts) or self.suite_over
        if over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    # Last, after --durations: a CI log keeps only its tail, and the verdict is what it needs.
    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        if not self.config.getoption("budget"):
            return
        write = terminalreporter.write_line
        terminalreporter.section("time budget (tests/suite_budget.py)")
        for verdict in self.verdicts:
            if verdict.over:
                write(f"OVER BUDGET {verdict.line()}", red=True)
        if self.suite_line:
            prefix = "OVER BUDGET " if self.suite_over else ""
            write(f"{prefix}{self.suite_line}", red=self.suite_over)
        else:
            write("the suite's budget is judged only on a whole run (no -m, -k or paths)")
        write(
            f"{sum(not v.over for v in self.verdicts)} files within budget; durations: {self.out}"
        )


def _whole_suite(config) -> bool:
    """The run is the whole suite: its default paths, nothing selected by marker or name."""
    default_paths = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    return default_paths and not config.option.markexpr and not config.option.keyword


def pytest_configure(config):
    config.pluginmanager.register(_WorkerClock(), "budget-clock")  # idle where no test runs
    if not _is_worker(config):
        config.pluginmanager.register(_Budget(config), "budget")


# --------------------------------------------------------------------------- commands

FIGURE = re.compile(r"(<!-- suite-figure -->)(.*?)(<!-- /suite-figure -->)", re.S)


def figure(record: dict) -> str:
    """The README's sentence on the suite's size and time, from the record."""
    suite = record["suite"]
    return (
        f"{suite['tests']} tests, {suite['wall_s'] / 60:.1f} minutes on an idle 2-core machine "
        f"(recorded {suite['date']} in `tests/durations.json`; the budget is "
        f"{SUITE_BUDGET_S // 60} minutes)"
    )


def readme_with_figure(readme: str, record: dict) -> str:
    if not FIGURE.search(readme):
        raise SystemExit("README.md has no <!-- suite-figure --> ... <!-- /suite-figure -->")
    return FIGURE.sub(lambda m: m.group(1) + figure(record) + m.group(3), readme)


def _full_run(path: Path) -> dict:
    run = json.loads(path.read_text())
    if not run["suite"]["complete"]:
        raise SystemExit(f"{path}: not a full run (every file, every test); nothing recorded")
    return run


def slowest_per_file(run: dict, earlier: list[dict]) -> dict:
    """``run`` with each file's wall time and CPU-seconds the largest of it and the earlier
    runs of the same tests (a file whose test count changed keeps ``run``'s): one run's
    times are one draw of what the other worker happened to run beside each file."""
    files = {}
    for name, entry in run["files"].items():
        same = [e["files"][name] for e in earlier if name in e["files"]]
        same = [entry, *(e for e in same if e["tests"] == entry["tests"])]
        slowest = max(same, key=lambda e: e["wall_s"])
        files[name] = dict(slowest, cpu_s=max(e["cpu_s"] for e in same))
    return dict(run, files=files)


def record_last_run(
    last: Path = LAST_FULL_RUN,
    record: Path = RECORD,
    readme: Path = README,
    earlier: tuple[Path, ...] = (),
) -> None:
    """The last full run (its files at the slowest of it and ``earlier`` full runs) becomes
    the record, and the README's figure is its suite's time."""
    run = slowest_per_file(_full_run(last), [_full_run(path) for path in earlier])
    record.write_text(json.dumps(run, indent=1) + "\n")
    readme.write_text(readme_with_figure(readme.read_text(), run))
    print(f"recorded {len(run['files'])} files; README: {figure(run)}")


def judge_ci(seconds: float, last: Path = LAST_FULL_RUN, record: Path = RECORD) -> int:
    """0 when a CI run of ``seconds`` is within ``CI_BUDGET_S`` at the recorded load (the
    test run's load ratio stands for the whole CI run's)."""
    if not last.is_file():
        print(f"OVER BUDGET? {last}: no run of the whole suite to judge the CI run by")
        return 1
    run, recorded = json.loads(last.read_text()), load_record(record)
    ratio = load_ratio([], 0, 0, None, 1.0)
    if run["suite"].get("contention") and recorded.get("suite", {}).get("contention"):
        ratio = min(max(run["suite"]["contention"] / recorded["suite"]["contention"], 0.5), 10.0)
    speed = speed_ratio(
        run["suite"].get("calibration_s"), recorded.get("suite", {}).get("calibration_s")
    )
    normalised = normalised_seconds(seconds, ratio, speed)
    over = normalised > CI_BUDGET_S
    print(
        f"{'OVER BUDGET ' if over else ''}CI took {seconds / 60:.1f} min "
        f"({normalised / 60:.1f} min at the recorded load and speed, speed ratio {speed:.2f}) "
        f"against its budget of {CI_BUDGET_S // 60} min"
    )
    return int(over)


if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["record"]:
        record_last_run(earlier=tuple(Path(path) for path in sys.argv[2:]))
    elif command == ["ci"] and len(sys.argv) == 3:
        sys.exit(judge_ci(float(sys.argv[2])))
    else:
        usage = "record [EARLIER_FULL_RUN.json ...] | ci SECONDS"
        sys.exit(f"usage: {os.path.basename(sys.argv[0])} {usage}")
