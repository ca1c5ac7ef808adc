"""What the GPU check runs: its targets, and the shapes, steps and time budget of each section,
on one GPU or, for the CPU dry run, tiny enough to run in the test suite.

Designs and their options are data here (``targets.yaml``) or come from the registry, so a new
design is timed and trained without a change to the check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

SETTINGS_FILE = Path(__file__).with_name("targets.yaml")
SECTIONS = ("env", "correctness", "step_cost", "mfu", "kernels", "profile")  # the order they run in


@dataclass(frozen=True)
class Settings:
    """``targets.yaml``: targets and design options."""

    step_preset: str
    step_targets: dict  # variant -> max step time / the baseline's
    kernel_min_vs_best_peer: float
    kernel_options: dict  # window, depth_window, ddl_widths, block_size
    mfu_preset: str
    mfu_min: float
    dry_run_overrides: tuple[str, ...]
    dry_run_kernel_options: dict
    cost: dict = field(default_factory=dict)  # step_time, max_time_over_flops, peak_memory


def load_settings(path: Path = SETTINGS_FILE) -> Settings:
    raw = yaml.safe_load(path.read_text())
    return Settings(
        step_preset=raw["step_cost"]["preset"],
        step_targets={str(k): float(v) for k, v in raw["step_cost"]["targets"].items()},
        kernel_min_vs_best_peer=float(raw["kernels"]["min_vs_best_peer"]),
        kernel_options=raw["kernels"]["options"], mfu_preset=raw["mfu"]["preset"],
        mfu_min=float(raw["mfu"]["min_mfu"]),
        dry_run_overrides=tuple(raw["dry_run"]["overrides"]),
        dry_run_kernel_options=raw["dry_run"]["kernel_options"], cost=raw.get("cost") or {})


def baseline() -> str:
    from t2train.residual import BASELINE

    return BASELINE


def with_mixer(design: str) -> str:
    from t2train.residual import mixer

    return f"{design}+{mixer().name}"


def _unique(names) -> list[str]:
    return list(dict.fromkeys(names))


def step_variants(settings: Settings, designs: tuple[str, ...]) -> list[str]:
    """The baseline, the targeted variants, the other designs; then with the mixer (after the
    plain-PyTorch loop, so they are the first to go when time runs out)."""
    return _unique([baseline(), *settings.step_targets, *designs])


def mixer_variants(settings: Settings, designs: tuple[str, ...]) -> list[str]:
    return [name for name in _unique(with_mixer(d) for d in designs)
            if name not in step_variants(settings, designs)]


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

    @property
    def step_preset(self) -> str:
        return "tiny" if self.dry_run else self.settings.step_preset

    @property
    def mfu_preset(self) -> str:
        return "tiny" if self.dry_run else self.settings.mfu_preset

    @property
    def kernel_options(self) -> dict:
        return (self.settings.dry_run_kernel_options if self.dry_run
                else self.settings.kernel_options)


# The correctness runs compare trajectories, so they train where the tiny model is stable: at
# the preset's lr 3e-3 a loss bump near step 12 amplified bf16 rounding to 4% on the CPU. One
# micro-batch of 8 per step halves the CPU reference's work.
CORRECTNESS_RUN = ("train.warmup_steps=5", "train.lr=1e-3", "train.min_lr=1e-4",
                   "train.global_batch_size=8")
# Two micro-batches per step keep ~20 steps of every variant inside the budget; a 32k
# vocabulary (the dataset's is 4k) gives the presets their intended embedding and output cost.
GPU_STEP = ("train.global_batch_size=32", "model.vocab_size=32000")
GPU_MFU = ("train.global_batch_size=8", "model.vocab_size=32000")


def make_plan(dry_run: bool, data: str) -> Plan:
    settings = load_settings()
    if dry_run:
        tiny = settings.dry_run_overrides
        return Plan(
            dry_run=True, data=data, settings=settings,
            budgets={"env": 60, "correctness": 240, "step_cost": 120, "mfu": 60, "kernels": 120,
                     "profile": 60},
            matmul_size=256, gpu_tests=("tests/kernels/test_ddl_kernel.py",),
            train_preset="tiny", train_overrides=tiny + ("train.warmup_steps=1",),
            train_steps=2, loss_rtol=0.01,
            kernel_presets=(("tiny", "tiny", tiny + ("model.seq_length=8",
                                                     "train.micro_batch_size=1")),),
            step_overrides=tiny, step_warmup=1, step_steps=1,
            mfu_overrides=tiny, mfu_warmup=1, mfu_steps=1, profile_warmup=1, profile_steps=1)
    return Plan(
        dry_run=False, data=data, settings=settings,
        # 570 s in all. On an H100 the sections took 17, 108-119, 113-118, 45, 85 (before
        # the depth-read and gate-logit cases) and 64 s; with the bundle's install and the
        # start-up the first run (without the profile, 470 s planned) took 390 s of its 10
        # minutes. A run stopped at 10 minutes keeps every finished section's report.
        budgets={"env": 20, "correctness": 150, "step_cost": 120, "mfu": 60, "kernels": 150,
                 "profile": 70},
        matmul_size=8192, gpu_tests=("tests",), train_preset="tiny",
        train_overrides=CORRECTNESS_RUN, train_steps=20, loss_rtol=0.01,
        kernel_presets=(("125m", "125m", ()), ("1b", "1b", ())),
        step_overrides=GPU_STEP, step_warmup=3, step_steps=10,
        mfu_overrides=GPU_MFU, mfu_warmup=4, mfu_steps=16, profile_warmup=2, profile_steps=2)
