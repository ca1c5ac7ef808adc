"""What the GPU check runs: its targets, and the shapes, steps and time budget of each section,
on one GPU or, for the CPU dry run, tiny enough to run in the test suite."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

TARGETS_FILE = Path(__file__).with_name("gpu_targets.yaml")
SECTIONS = ("env", "correctness", "step_cost", "mfu", "kernels")  # the order they run in


@dataclass(frozen=True)
class Variant:
    """A named set of config overrides (a design and its options) timed by the step cost."""

    name: str
    overrides: tuple[str, ...]
    max_ratio: Optional[float] = None  # target: step time / the baseline's


def _variant(entry: dict) -> Variant:
    return Variant(str(entry["name"]), tuple(entry["overrides"]), entry.get("max_ratio"))


@dataclass(frozen=True)
class Targets:
    step_preset: str
    baseline: Variant
    step_targets: tuple[Variant, ...]
    kernel_min_vs_best_peer: float
    mfu_preset: str
    mfu_variant: Variant
    mfu_min: float


def load_targets(path: Path = TARGETS_FILE) -> Targets:
    raw = yaml.safe_load(path.read_text())
    step, mfu = raw["step_cost"], raw["mfu"]
    return Targets(step["preset"], _variant(step["baseline"]),
                   tuple(_variant(entry) for entry in step["variants"]),
                   float(raw["kernels"]["min_vs_best_peer"]), mfu["preset"],
                   _variant(mfu["variant"]), float(mfu["min_mfu"]))


def step_variants(targets: Targets, designs: tuple[str, ...]) -> list[Variant]:
    """The baseline, the targeted variants, then each other registered design at its defaults."""
    variants = [targets.baseline, *targets.step_targets]
    covered = {item for variant in variants for item in variant.overrides}
    return variants + [Variant(design, (f"model.residual={design}",)) for design in designs
                       if f"model.residual={design}" not in covered]


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
    targets: Targets = field(default_factory=load_targets)

    @property
    def step_preset(self) -> str:
        return "tiny" if self.dry_run else self.targets.step_preset

    @property
    def mfu_preset(self) -> str:
        return "tiny" if self.dry_run else self.targets.mfu_preset


# The correctness runs compare trajectories, so they train where the tiny model is stable: at
# the preset's lr 3e-3 a loss bump near step 12 amplified bf16 rounding to 4% on the CPU. One
# micro-batch of 8 per step halves the CPU reference's work.
CORRECTNESS_RUN = ("train.warmup_steps=5", "train.lr=1e-3", "train.min_lr=1e-4",
                   "train.global_batch_size=8")
# Two micro-batches per step keep ~20 steps of every variant inside the budget; a 32k
# vocabulary (the dataset's is 4k) gives the presets their intended embedding and output cost.
GPU_STEP = ("train.global_batch_size=32", "model.vocab_size=32000")
GPU_MFU = ("train.global_batch_size=8", "model.vocab_size=32000")
# The dry run: 2 layers of width 32 (Block AttnRes blocks of 2 sublayers), GQA, short sequences.
DRY_MODEL = ("model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2",
             "model.num_query_groups=1", "model.seq_length=16", "model.attnres.block_size=2",
             "model.shortswa.window=4", "train.micro_batch_size=2", "train.global_batch_size=4")


def make_plan(dry_run: bool, data: str) -> Plan:
    if dry_run:
        return Plan(
            dry_run=True, data=data,
            budgets={"env": 60, "correctness": 240, "step_cost": 120, "mfu": 60, "kernels": 120},
            matmul_size=256, gpu_tests=("tests/kernels/test_ddl_kernel.py",), train_preset="tiny",
            train_overrides=DRY_MODEL + ("train.warmup_steps=1",), train_steps=2,
            loss_rtol=0.01,
            kernel_presets=(("tiny", "tiny", DRY_MODEL + ("model.seq_length=8",
                                                          "train.micro_batch_size=1")),),
            step_overrides=DRY_MODEL, step_warmup=1, step_steps=1,
            mfu_overrides=DRY_MODEL, mfu_warmup=1, mfu_steps=1)
    return Plan(
        dry_run=False, data=data,
        # 470 s in all: with the bundle's install and the start-up, under 9 minutes.
        budgets={"env": 20, "correctness": 130, "step_cost": 110, "mfu": 70, "kernels": 140},
        matmul_size=8192, gpu_tests=("tests",), train_preset="tiny",
        train_overrides=CORRECTNESS_RUN, train_steps=20,
        loss_rtol=0.01, kernel_presets=(("125m", "125m", ()), ("1b", "1b", ())),
        step_overrides=GPU_STEP, step_warmup=3, step_steps=10,
        mfu_overrides=GPU_MFU, mfu_warmup=4, mfu_steps=16)
