"""What the GPU check runs: its targets, and the shapes, steps and time budget of each section,
on one GPU or, for the CPU dry run, tiny enough to run in the test suite.

Designs and their options are data here (``targets.yaml``) or come from the registry, so a new
design is timed and trained without a change to the check.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

SETTINGS_FILE = Path(__file__).with_name("targets.yaml")
SECTIONS = ("env", "correctness", "step_cost", "mfu", "kernels", "profile")  # the order they run in
# --quick: what iterating on the hot path needs, in about 4 minutes: the baseline and the
# targeted variants against both plain-PyTorch loops, MFU, and where the baseline's time goes.
QUICK_SECTIONS = ("env", "step_cost", "mfu", "profile")
# --stack: what users do after pressing train, in its own 10-minute command (docs/gpu/README.md):
# every GPU-marked test with the time it needs, resume, DeepSpeed, the planner's memory against
# the measured peak, FP8 and recompute against their defaults, TensorBoard and export, and the
# multi-GPU tests where there are GPUs.
STACK_SECTIONS = (
    "env",
    "gpu_tests",
    "resume",
    "deepspeed",
    "memory",
    "options",
    "outputs",
    "multi_gpu",
)
# The GPU window as two 10-minute calls (docs/gpu/README.md, "What the check runs"). --speed: the
# headline at both presets (interleaved repeats), every variant's step cost and memory, MFU,
# a profile of every design. --quality: bf16 correctness of every design, every kernel row,
# then the GPU comparison (comparison.yaml) until the call's time is up.
SPEED_SECTIONS = ("env", "step_cost", "mfu", "profile")
QUALITY_SECTIONS = ("env", "correctness", "kernels", "comparison")
MODES = ("full", "quick", "stack", "speed", "quality")
ALL_SECTIONS = tuple(dict.fromkeys(SECTIONS + STACK_SECTIONS + SPEED_SECTIONS + QUALITY_SECTIONS))


@dataclass(frozen=True)
class Settings:
    """``targets.yaml``: the targets, and the presets and overrides the check runs at."""

    step_preset: str
    kernel_min_vs_best_peer: float
    mfu_preset: str
    mfu_min: float  # by the causal count (t2train/model/flops.py), of the data-sheet peak
    reference_min_speed: float  # baseline tokens/s / the strongest plain-PyTorch reference's
    reference_max_memory: float  # baseline peak memory / that reference's
    dry_run_overrides: tuple[str, ...]
    stack: dict  # the --stack sections' variants, steps and tolerances
    # variant -> {"step_time": {preset: limit}, "time_over_flops": limit, "peak_memory": limit}
    designs: dict = field(default_factory=dict)
    mixer_margin: float = 1.03  # <design>+<mixer> <= design's ratio x the mixer's x this
    repeats: int = 3  # the headline rows, interleaved
    max_spread: float = 0.05  # repeats of a row further apart than this are flagged

    def step_limit(self, variant: str, preset: str) -> Optional[float]:
        """``variant``'s step-time limit (vs the baseline) at ``preset``, if it has one."""
        return (self.designs.get(variant) or {}).get("step_time", {}).get(preset)

    def variants_at(self, preset: str) -> list[str]:
        """The variants with a step-time target at ``preset``."""
        return [name for name in self.designs if self.step_limit(name, preset) is not None]


def load_settings(path: Path = SETTINGS_FILE) -> Settings:
    raw = yaml.safe_load(path.read_text())
    designs = {
        str(variant): {
            "step_time": {str(p): float(v) for p, v in (limits.get("step_time") or {}).items()},
            **{
                key: float(limits[key])
                for key in ("time_over_flops", "peak_memory")
                if limits.get(key) is not None
            },
        }
        for variant, limits in (raw.get("designs") or {}).items()
    }
    headline = raw.get("headline") or {}
    return Settings(
        step_preset=raw["step_cost"]["preset"],
        kernel_min_vs_best_peer=float(raw["kernels"]["min_vs_best_peer"]),
        mfu_preset=raw["mfu"]["preset"],
        mfu_min=float(raw["mfu"]["min_mfu"]),
        reference_min_speed=float(raw["reference"]["min_speed"]),
        reference_max_memory=float(raw["reference"]["max_memory"]),
        dry_run_overrides=tuple(raw["dry_run"]["overrides"]),
        stack=raw["stack"],
        designs=designs,
        mixer_margin=float((raw.get("mixer") or {}).get("margin", 1.03)),
        repeats=int(headline.get("repeats", 3)),
        max_spread=float(headline.get("max_spread", 0.05)),
    )


def baseline() -> str:
    from t2train.residual import BASELINE

    return BASELINE


def with_mixer(design: str) -> str:
    from t2train.residual import mixer

    return f"{design}+{mixer().name}"


def _unique(names) -> list[str]:
    return list(dict.fromkeys(names))


def step_variants(settings: Settings, designs: tuple[str, ...], quick: bool = False) -> list[str]:
    """The baseline, the targeted variants, the other designs (not in a quick run); then with
    the mixer (``mixer_variants``, the first to go when time runs out). The step-cost section
    times the plain-PyTorch loops right after the baseline."""
    return _unique([baseline(), *settings.designs, *(() if quick else designs)])


def mfu_variants(settings: Settings) -> list[str]:
    """The baseline, then the variants with a step-time target at the MFU preset (timed there
    after the headline, while time lasts)."""
    return _unique([baseline(), *settings.variants_at(settings.mfu_preset)])


def mixer_variants(settings: Settings, designs: tuple[str, ...], quick: bool = False) -> list[str]:
    if quick:
        return []
    return [
        name
        for name in _unique(with_mixer(d) for d in designs)
        if name not in step_variants(settings, designs)
    ]


def correctness_variants(designs: tuple[str, ...]) -> list[str]:
    """Every design, and the baseline with the mixer (the window-attention kernel in training)."""
    return [*designs, with_mixer(baseline())]


@dataclass(frozen=True)
class Plan:
    dry_run: bool
    data: str  # a prepared dataset with samples of at least every section's sequence length
    budgets: dict  # section -> seconds; a section may also use what earlier ones left unspent
    matmul_size: int  # n of the n^3 bf16 matmul that measures the peak
    gpu_tests: tuple[str, ...]  # where `pytest -m gpu` looks
    train_preset: str  # correctness: bf16 vs the fp32 CPU reference
    train_overrides: tuple[str, ...]
    train_steps: int
    loss_rtol: float  # per step: |bf16 - fp32| <= loss_rtol * fp32
    kernel_presets: tuple  # (label, preset, overrides) whose shapes the kernels run at
    step_overrides: tuple[str, ...]
    step_warmup: int
    step_steps: int
    mfu_overrides: tuple[str, ...]
    mfu_warmup: int
    mfu_steps: int
    profile_warmup: int
    profile_steps: int
    settings: Settings = field(default_factory=load_settings)
    # "full" (SECTIONS), "quick" (QUICK_SECTIONS, the baseline and the targeted variants
    # only), "stack" (STACK_SECTIONS, a command of its own), "speed" and "quality" (the GPU
    # window's two calls)
    mode: str = "full"
    rehearsal: bool = False  # a dry run of one item per section (the test suite's)
    repeats: int = 3  # of the headline rows (the baseline and the compiled reference), interleaved
    out: str = ""  # the check's output folder (the comparison's records go there)

    @property
    def quick(self) -> bool:
        return self.mode == "quick"

    @property
    def stack(self) -> bool:
        return self.mode == "stack"

    def items(self, names: Iterable) -> list:
        """A section's items: all of them, or the first in a rehearsal (every section's code
        runs once on the CPU, in a minute or two instead of several)."""
        return list(names)[:1] if self.rehearsal else list(names)

    @property
    def sections(self) -> tuple[str, ...]:
        """The sections a run without --only runs, in order."""
        return {
            "full": SECTIONS,
            "quick": QUICK_SECTIONS,
            "stack": STACK_SECTIONS,
            "speed": SPEED_SECTIONS,
            "quality": QUALITY_SECTIONS,
        }[self.mode]

    @property
    def report_sections(self) -> tuple[str, ...]:
        """The sections this run's report lists (those not asked for say so)."""
        return SECTIONS if self.mode == "quick" else self.sections

    def stack_run(self, name: str) -> tuple[str, tuple[str, ...]]:
        """(preset, overrides) of the --stack section ``name``: its preset and shape on the
        GPU, the dry run's tiny ones on the CPU; then its run overrides."""
        raw = self.settings.stack[name]
        if self.dry_run:
            return "tiny", (*self.settings.dry_run_overrides, *raw["overrides"])
        return raw["preset"], (*raw["shape"], *raw["overrides"])

    @property
    def step_preset(self) -> str:
        return "tiny" if self.dry_run else self.settings.step_preset

    @property
    def mfu_preset(self) -> str:
        return "tiny" if self.dry_run else self.settings.mfu_preset


# The correctness runs compare trajectories, so they train where the tiny model is stable: at
# the preset's lr 3e-3 a loss bump near step 12 amplified bf16 rounding to 4% on the CPU. One
# micro-batch of 8 per step halves the CPU reference's work.
CORRECTNESS_RUN = (
    "train.warmup_steps=5",
    "train.lr=1e-3",
    "train.min_lr=1e-4",
    "train.global_batch_size=8",
)
# Two micro-batches per step keep ~20 steps of every variant inside the budget; a 32k
# vocabulary (the dataset's is 4k) gives the presets their intended embedding and output cost.
GPU_STEP = ("train.global_batch_size=32", "model.vocab_size=32000")
GPU_MFU = ("train.global_batch_size=8", "model.vocab_size=32000")


# The --stack sections on one GPU: 440 s in all, so that the command (install and start-up
# included, about 30 s) fits 10 minutes with time to spare. Not yet measured on a GPU: guesses
# from the check's sections (the GPU-marked tests took 59 s of pytest on an H100; a process
# start with CUDA and a compiled 20m model, about 20 s).
STACK_BUDGETS = {
    "env": 20,
    "gpu_tests": 90,
    "resume": 110,
    "deepspeed": 70,
    "memory": 50,
    "options": 160,  # four 300-step runs at 125m (about 25 s each, compile included), then 1b
    "outputs": 50,
    "multi_gpu": 20,
}
# The dry run: tiny shapes on the CPU, each section well inside its time.
DRY_RUN_STACK_BUDGETS = {
    "env": 60,
    "gpu_tests": 120,
    "resume": 180,
    "deepspeed": 180,
    "memory": 60,
    "options": 120,
    "outputs": 60,
    "multi_gpu": 30,
}


# The quick dry run's step cost runs the fused path with the Triton kernels under the
# interpreter, which takes seconds per call: half the sequence (the MFU section keeps the
# dry run's shape, eager kernels).
QUICK_KERNEL_SHAPE = ("model.fusions=all", "model.seq_length=8")


# The GPU's section budgets (seconds) per mode; STACK_BUDGETS for --stack. Each mode plans at
# most 580 s, so that the command (the bundle's install, about 10 s, and the worker's start
# included) fits a 10-minute call.
#
# full (580 s): eager, on an H100 the sections took 17, 108-119, 113-118, 45, 85 and 64 s;
# on an H200 (2026-11-30, fused path) the step-cost section measured 11 of 16 items in 160 s.
# The headline's three interleaved repeats at 1b (t2train, then the compiled reference in a
# process of its own, three times) are about 140 s on a cold machine (estimated from the
# H200's 555 / 599 ms steps, 20 s compiles and ~6 s process starts): the MFU section gets
# 150 s, taken from the correctness and kernel sections, whose rows --quality has in full.
# quick (240 s): two repeats of the headline rows.
# speed (540 s): the headline at 125m (about 95 s cold) then all 14 variants (a cold compile
# of 9-25 s each, then 13 steps) in the step-cost section, the headline at 1b in the MFU
# section, a profile of every design with Inductor's cache warm from the step-cost section.
# quality (540 s): the correctness section as in the full check (the H200 needed its 170 s),
# every kernel row (148 s on an H200 from the command line), the comparison in the rest.
GPU_BUDGETS = {
    "full": {
        "env": 20,
        "correctness": 150,
        "step_cost": 150,
        "mfu": 150,
        "kernels": 60,
        "profile": 50,
    },
    "quick": {"env": 15, "step_cost": 90, "mfu": 105, "profile": 30},
    "speed": {"env": 15, "step_cost": 310, "mfu": 160, "profile": 55},
    "quality": {"env": 15, "correctness": 170, "kernels": 180, "comparison": 175},
}
GPU_REPEATS = {"quick": 2}  # of the headline rows; else Settings.repeats
DRY_RUN_BUDGETS = {
    "env": 60,
    "correctness": 240,
    "step_cost": 180,
    "mfu": 150,
    "kernels": 120,
    "profile": 60,
    "comparison": 120,
}


def make_plan(
    dry_run: bool,
    data: str,
    quick: bool = False,
    stack: bool = False,
    rehearsal: bool = False,
    mode: Optional[str] = None,
    out: str = "",
) -> Plan:
    """The plan of a run in ``mode`` (or, as before modes had names, ``quick`` / ``stack``)."""
    settings = load_settings()
    mode = mode or ("quick" if quick else "stack" if stack else "full")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    repeats = GPU_REPEATS.get(mode, settings.repeats)
    if dry_run or rehearsal:
        tiny = settings.dry_run_overrides
        return Plan(
            dry_run=True,
            data=data,
            settings=settings,
            mode=mode,
            rehearsal=rehearsal,
            repeats=1 if rehearsal else repeats,
            out=out,
            budgets={**DRY_RUN_BUDGETS, **DRY_RUN_STACK_BUDGETS},
            matmul_size=256,
            gpu_tests=("tests/kernels/test_fp32_linear_kernel.py",),
            train_preset="tiny",
            train_overrides=tiny + ("train.warmup_steps=1",),
            train_steps=2,
            loss_rtol=0.01,
            kernel_presets=(
                ("tiny", "tiny", tiny + ("model.seq_length=8", "train.micro_batch_size=1")),
            ),
            # The fused path (compiled with aot_eager, check.py) in the MFU section, and in the
            # quick run's step-cost section, with the kernels under the interpreter, as the GPU
            # runs them: a section whose compiles would not fit shows here. The full run's
            # step cost stays eager: compiling its 16 items takes this CPU about 5 minutes.
            step_overrides=tiny + (QUICK_KERNEL_SHAPE if mode == "quick" else ()),
            step_warmup=1,
            step_steps=1,
            mfu_overrides=tiny + ("model.fusions=all",),
            mfu_warmup=1,
            mfu_steps=1,
            profile_warmup=1,
            profile_steps=1,
        )
    gpu = GPU_BUDGETS.get(mode, {})
    return Plan(
        dry_run=False,
        data=data,
        settings=settings,
        mode=mode,
        repeats=repeats,
        out=out,
        # A run stopped at 10 minutes keeps every finished section's report.
        budgets=dict.fromkeys(ALL_SECTIONS, 0)
        | {name: STACK_BUDGETS[name] for name in STACK_SECTIONS if name not in gpu}
        | gpu,
        matmul_size=8192,
        gpu_tests=("tests",),
        train_preset="tiny",
        train_overrides=CORRECTNESS_RUN,
        train_steps=20,
        loss_rtol=0.01,
        kernel_presets=(("125m", "125m", ()), ("1b", "1b", ())),
        step_overrides=GPU_STEP,
        step_warmup=3,
        step_steps=10,
        # Three repeats of 3 + 10 steps (30 timed) in the time 4 + 16 took once.
        mfu_overrides=GPU_MFU,
        mfu_warmup=3,
        mfu_steps=10,
        profile_warmup=2,
        profile_steps=2,
    )
