"""GPU check, performance: step cost of every design variant, and MFU of the MFU preset.

Both time real training steps through ``t2train bench step``'s code (``time_design``): the
same pre-read batches for every variant, warm-up steps untimed (their time, compilation
included, is reported apart), the median of the timed ones, every step's time kept in the
JSON. A variant is ``<design>`` or ``<design>+shortswa``, as ``t2train bench step --designs``
takes it.

The headline of each section: t2train's baseline against the plain-PyTorch reference
(``t2train/bench/reference_gpt.py``: its blocks and its loss compiled, RoPE's tables built
once), whose runs are timed in a process of its own (``ReferenceProcess``), not after t2train's
compiles in this one. The baseline and the compiled reference are timed
``plan.repeats`` times in turns (t2train, reference, t2train, reference, ...), so that a
change of the machine's state affects both; each row keeps every repeat, and the report gives
their spread. Then the eager reference, once.

Items run in the order of what the section must answer, so that a section short of time
drops the least needed. Step cost (125m): the headline, the eager reference, the targeted
designs, the others, then those with the mixer. MFU (1b): the headline, the variants with a
step-time target at 1b, then the eager reference.
"""

from __future__ import annotations

import atexit
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Optional

from tools.gpu_check.items import (
    REPEAT_FIELDS,
    add_repeat,
    flop_counts,
    summary_of_repeats,
    timing_item,
    variant_config,
)
from tools.gpu_check.plan import Plan, baseline, mfu_variants, mixer_variants, step_variants

# A reference run is given the section's time left plus this, so that it is stopped (and
# recorded as an error) before the check stops the section's worker, GRACE seconds past its end.
CHILD_GRACE = 10.0


def _timed(section, name: str, measure, estimate: float, **extra) -> Optional[dict]:
    """Run ``measure()`` if it fits the section's time, else record why it was skipped; the
    item recorded."""
    if not section.fits(estimate):
        section.add(dict(extra, name=name, status="skipped", reason=section.no_time(estimate)))
        return None
    started = time.monotonic()
    try:
        item = dict(timing_item(name, measure(), **extra), status="ok")
    except Exception as err:  # reported; the other variants still run
        item = dict(extra, name=name, **section.error(err))
    item["seconds"] = time.monotonic() - started
    section.add(item)
    return item


def _again(section, item: dict, measure, max_spread: float) -> None:
    """A later repeat of the row ``item``, merged into it (``items.add_repeat``) if it fits
    the section's time: its estimate is the row's last repeat less its warm-up, plus the
    row's smallest warm-up (a repeat compiles from Inductor's cache)."""
    if item.get("status") != "ok":
        return
    runs = item["repeats"]
    estimate = (
        runs[-1]["seconds"]
        - (runs[-1].get("warmup_s") or 0.0)
        + min(run.get("warmup_s") or 0.0 for run in runs)
    )
    if not section.fits(estimate):
        item.setdefault("repeats_not_run", []).append(section.no_time(estimate))
        section.save()
        return
    started = time.monotonic()
    try:
        timing = measure()
    except Exception as err:  # reported; the row keeps its repeats so far
        item.setdefault("repeats_failed", []).append(section.error(err)["reason"])
        section.note_run(time.monotonic() - started, 0.0)
        section.save()
        return
    repeat = dict(timing_item(item["name"], timing), seconds=time.monotonic() - started)
    item.update(add_repeat(item, repeat, max_spread))
    section.note_run(repeat["seconds"], repeat["warmup_s"])
    section.save()


class ReferenceProcess:
    """The plain-PyTorch reference's own process (``python -m t2train.bench.reference_gpt
    --serve``): started at the first reference run of the check's worker and shared by its
    sections, it times each run it is sent (a new shape compiles from a fresh dynamo state; a
    repeat reuses the graphs, which shortens its warm-up only) and frees the device between
    runs. Nothing t2train compiled or allocated in this process is there when the reference
    compiles and runs, and the check pays one process start (CUDA's and dynamo's included)
    rather than one per run."""

    def __init__(self, scratch: Path):
        self.log = scratch / "reference.log"
        self.proc: Optional[subprocess.Popen] = None
        self.log_stream: Optional[IO] = None
        self.lines: queue.Queue = queue.Queue()

    def _start(self) -> subprocess.Popen:
        from tools.gpu_check.correctness import REPO, child_env

        self.log_stream = self.log.open("a")
        proc = subprocess.Popen(
            [sys.executable, "-m", "t2train.bench.reference_gpt", "--serve"],
            env=child_env(),
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log_stream,
            text=True,
        )

        def read(stream=proc.stdout, lines=self.lines) -> None:
            for line in stream:
                lines.put(line)
            lines.put(None)  # the process ended

        threading.Thread(target=read, daemon=True).start()
        return proc

    def run(self, spec: dict, timeout: float) -> dict:
        """The result of timing ``spec``; raises if the process fails, ends or overruns."""
        from t2train.bench.reference_gpt import RESULT

        if self.proc is None or self.proc.poll() is not None:
            self.lines = queue.Queue()
            self.proc = self._start()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + max(timeout, 1.0)
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.close()
                raise TimeoutError(
                    f"the reference's process took more than {timeout:.0f}s"
                ) from None
            if line is None:
                tail = " | ".join(self.log.read_text().strip().splitlines()[-6:])
                raise RuntimeError(
                    f"the reference's process ended (exit {self.proc.wait()}): {tail[-1500:]}"
                )
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT) :])
                if "error" in result:
                    raise RuntimeError(f"in the reference's process: {result['error']}")
                return result

    def close(self) -> None:
        """End the process and reap it (a run overran, or this worker exits: atexit); the
        next run starts another."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.log_stream is not None:
            self.log_stream.close()
        self.proc, self.log_stream = None, None


_SHARED: dict = {}  # this worker's ReferenceProcess


def reference_process(folder: Path) -> ReferenceProcess:
    """This worker's reference process (its log in ``folder``), started on first use."""
    if "process" not in _SHARED:
        _SHARED["process"] = ReferenceProcess(folder)
        atexit.register(_SHARED["process"].close)
    return _SHARED["process"]


class Headline:
    """The baseline against the plain-PyTorch reference in one section, at one shape."""

    def __init__(self, section, plan: Plan, config, vocab: int, batches: list, warmup: int):
        import torch

        self.section, self.plan, self.config, self.vocab = section, plan, config, vocab
        self.warmup = warmup
        self.flops = flop_counts(config.model, vocab)
        self.batches = section.scratch / "batches.pt"  # what the reference's process reads
        torch.save(batches, self.batches)
        self.process = reference_process(section.scratch.parent)

    def reference(self, compiled: bool) -> Callable:
        """A run of the reference, eager or compiled (its blocks and its loss, with the fused
        path's backend), in its process; a ``DesignTiming``."""
        from t2train.bench.reference_gpt import spec_for
        from t2train.bench.step import reference_design_timing, reference_setup
        from t2train.nn.compiling import compile_backend

        shape, training = reference_setup(self.config, self.vocab)
        backend = compile_backend() if compiled else None
        spec = spec_for(shape, training, self.batches, self.warmup, backend)

        def measure():
            result = self.process.run(spec, timeout=self.section.left() + CHILD_GRACE)
            return reference_design_timing(
                self.config,
                compiled,
                result["warmup_samples"] + result["step_samples"],
                self.warmup,
                result["memory_gib"],
                result["params"],
            )

        return measure

    def run(self, ours: Callable) -> None:
        """t2train (``ours()``) and the compiled reference, ``plan.repeats`` times in turns."""
        from t2train.bench.step import COMPILED_REFERENCE

        section, max_spread = self.section, self.plan.settings.max_spread
        rows = [
            (baseline(), ours, {}),
            (COMPILED_REFERENCE, self.reference(True), {"reference": True, "compiled": True}),
        ]
        items: dict = {}
        for repeat in range(self.plan.repeats):
            for name, measure, extra in rows:
                if repeat == 0:
                    item = _timed(
                        section,
                        name,
                        measure,
                        section.next_item_seconds(default=30.0),
                        headline=True,
                        **self.flops,
                        **extra,
                    )
                    if item and item["status"] == "ok":
                        item.update(
                            summary_of_repeats(
                                [{key: item[key] for key in REPEAT_FIELDS if key in item}],
                                item["tokens_per_step"],
                                max_spread,
                            )
                        )
                        section.save()
                    items[name] = item
                elif items.get(name):
                    _again(section, items[name], measure, max_spread)

    def eager(self) -> None:
        from t2train.bench.step import REFERENCE

        _timed(
            self.section,
            REFERENCE,
            self.reference(False),
            self.section.next_item_seconds(default=30.0),
            reference=True,
            compiled=False,
            **self.flops,
        )


def _datasheet_tflops(config) -> Optional[float]:
    import torch

    from t2train.model.build import compute_dtype
    from t2train.monitor.mfu import peak_tflops

    if not torch.cuda.is_available():
        return None
    return peak_tflops(torch.cuda.get_device_name(), compute_dtype(config))


def step_cost(section, plan: Plan) -> None:
    from t2train.bench.step import model_vocab_size, real_batches, time_design
    from t2train.residual import registered
    from tools.gpu_check.memory import judged, plan_gib

    designs = registered()
    first = variant_config(plan, plan.step_preset, plan.step_overrides, baseline())
    vocab = model_vocab_size(first)
    section.data.update(
        preset=plan.step_preset,
        overrides=plan.step_overrides,
        warmup=plan.step_warmup,
        steps=plan.step_steps,
        repeats=plan.repeats,
        tokens_per_step=first.train.global_batch_size * first.model.seq_length,
        datasheet_tflops=_datasheet_tflops(first),
    )
    batches = real_batches(first, plan.step_warmup + plan.step_steps)
    max_error = float(plan.settings.stack["memory"]["max_error"])

    def with_plan(item: Optional[dict], config) -> None:
        if item and item.get("status") == "ok":  # the planner's estimate beside the measured peak
            item.update(judged(item["memory_gib"], plan_gib(config, vocab), max_error))
            section.save()

    def time_variant(name: str) -> None:
        config = variant_config(plan, plan.step_preset, plan.step_overrides, name)
        item = _timed(
            section,
            name,
            lambda: time_design(config, vocab, batches, plan.step_warmup, name),
            section.next_item_seconds(default=30.0),
            max_ratio=plan.settings.step_limit(name, plan.settings.step_preset),
            **flop_counts(config.model, vocab),
        )
        with_plan(item, config)

    base, *others = step_variants(plan.settings, designs, plan.quick)
    headline = Headline(section, plan, first, vocab, batches, plan.step_warmup)
    headline.run(lambda: time_design(first, vocab, batches, plan.step_warmup, base))
    with_plan(next((i for i in section.result["items"] if i["name"] == base), None), first)
    headline.eager()
    for name in plan.items([base, *others, *mixer_variants(plan.settings, designs, plan.quick)])[
        1:
    ]:
        time_variant(name)


def mfu(section, plan: Plan) -> None:
    import torch

    from t2train.bench.step import model_vocab_size, real_batches, time_design
    from t2train.model.build import compute_dtype

    base, *others = mfu_variants(plan.settings)
    config = variant_config(plan, plan.mfu_preset, plan.mfu_overrides, base)
    vocab = model_vocab_size(config)
    section.data.update(
        preset=plan.mfu_preset,
        overrides=plan.mfu_overrides,
        warmup=plan.mfu_warmup,
        steps=plan.mfu_steps,
        repeats=plan.repeats,
        precision=str(compute_dtype(config)).removeprefix("torch."),
        tokens_per_step=config.train.global_batch_size * config.model.seq_length,
        datasheet_tflops=_datasheet_tflops(config),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        **flop_counts(config.model, vocab),
    )
    batches = real_batches(config, plan.mfu_warmup + plan.mfu_steps)
    headline = Headline(section, plan, config, vocab, batches, plan.mfu_warmup)
    headline.run(lambda: time_design(config, vocab, batches, plan.mfu_warmup, base))
    for name in plan.items([base, *others])[1:]:  # the targets at 1b, while time lasts
        design = variant_config(plan, plan.mfu_preset, plan.mfu_overrides, name)
        _timed(
            section,
            name,
            lambda design=design, name=name: time_design(
                design, vocab, batches, plan.mfu_warmup, name
            ),
            section.next_item_seconds(default=60.0),
            max_ratio=plan.settings.step_limit(name, plan.settings.mfu_preset),
            **flop_counts(design.model, vocab),
        )
    headline.eager()
