"""``t2train experiment compare``: validation loss per residual variant over several seeds.

Each (variant, seed) trains through ``train(config)`` for the same steps, so the same tokens,
into its own run directory ``OUT/<variant>-seed<N>`` (``tensorboard --logdir OUT`` shows them
side by side), evaluating on the held-out split every ``train.eval_interval`` steps (by
default a tenth of the run). ``OUT/compare.md`` tabulates the loss at equal tokens and at
equal training FLOPs (``compare_report.py``) and links two figures written beside it
(``compare_figures.py``).

A batch is resumable: run the same command again after an interruption, and finished runs
are read from their directories, unfinished ones resume from their newest checkpoint
(``run_records.py``). A run that stops early (a signal, ``train.exit_duration_mins``) stops
the batch with the training command's requeue exit code.

A batch can also be completed in pieces, in a series of short jobs (the GPU comparison,
``tools/gpu_check/compare.py``, one 10-minute job each by default): ``--time-budget-min``
starts a run only while the slowest run so far still fits the budget, and ``--report-only``
trains nothing: it writes the report over the runs finished so far (whose records were
brought together in OUT) and lists the ones still missing.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # numpy: not imported to build the CLI's parser
    from t2train.bench.compare_report import VariantRuns


def _run_config(
    preset: Optional[str],
    config_file: Optional[str],
    overrides: list[str],
    variant: str,
    seed: int,
    steps: int,
    out: Path,
):
    from t2train.bench.variants import variant_config

    return variant_config(
        preset,
        config_file,
        [f"train.eval_interval={max(1, steps // 10)}", *overrides],
        variant,
        f"train.seed={seed}",
        f"train.steps={steps}",
        f"log.run_dir={out / f'{variant}-seed{seed}'}",
        "checkpoint.resume=auto",
    )


class Batch:
    """The runs of one ``compare`` command, trained, resumed or read in order."""

    def __init__(
        self,
        preset: Optional[str],
        config_file: Optional[str],
        overrides: list[str],
        variants: list[str],
        seeds: list[int],
        steps: int,
        out: Path,
        train_missing: bool = True,
        budget_s: Optional[float] = None,
    ):
        self.configs = {
            (variant, seed): _run_config(preset, config_file, overrides, variant, seed, steps, out)
            for variant in variants
            for seed in seeds
        }
        self.variants, self.seeds, self.steps = variants, seeds, steps
        self._check_equal_tokens()
        self.stopped: Optional[str] = None  # why a run stopped early, stopping the batch
        self.trained = self.read = 0
        self.train_missing, self.budget_s = train_missing, budget_s
        self.started, self.slowest_s = time.monotonic(), 0.0
        self.missing: list[str] = []  # runs neither finished earlier nor trained now

    def _check_equal_tokens(self) -> None:
        from t2train.config.schema import ConfigError

        per_step = {
            variant: _tokens_per_step(self.configs[variant, self.seeds[0]])
            for variant in self.variants
        }
        if len(set(per_step.values())) > 1:
            raise ConfigError(
                f"--designs: the variants train on different tokens per step "
                f"({per_step}); a comparison needs the same for every variant"
            )

    def run(self) -> list[VariantRuns]:
        """Every run's validation curve, or fewer variants if a run stopped early."""
        from t2train.bench.run_records import check_same_run

        for config in self.configs.values():  # before anything is trained
            check_same_run(config, Path(config.run_dir))
        results: list = []
        for variant in self.variants:
            curves = []
            for seed in self.seeds:
                curve = self._curve(self.configs[variant, seed])
                if self.stopped:
                    return results
                if curve:
                    curves.append(curve)
            if curves:
                results.append(_variant_runs(variant, curves, self.configs[variant, self.seeds[0]]))
        return results

    def _curve(self, config) -> dict[int, float]:
        from t2train.bench.run_records import finished_curve, val_curve
        from t2train.parallel.init import is_rank_zero
        from t2train.train.loop import train

        run_dir = Path(config.run_dir)
        curve = finished_curve(run_dir, self.steps)
        if curve:
            self.read += 1
            if is_rank_zero():
                print(f"{run_dir}: finished earlier, read its validation losses", flush=True)
            return curve
        if not self.train_missing or not self._time_for_another_run():
            self.missing.append(run_dir.name)
            return {}
        run_started = time.monotonic()
        summary = train(config)
        self.slowest_s = max(self.slowest_s, time.monotonic() - run_started)
        self.trained += 1
        if summary.stopped:
            self.stopped = (
                f"{run_dir} stopped early at step {summary.final_step} "
                f"({summary.stopped}), checkpoint {summary.checkpoint}"
            )
        return val_curve(run_dir)

    def _time_for_another_run(self) -> bool:
        """Whether a run as slow as the slowest so far still ends within the budget (every
        rank takes the decision of the one furthest behind)."""
        if self.budget_s is None:
            return True
        import torch  # deferred, as the imports above: the CLI imports this module for --help
        import torch.distributed as dist

        from t2train.parallel.init import current_device

        needed = time.monotonic() - self.started + self.slowest_s
        if dist.is_initialized():
            agreed = torch.tensor([needed], dtype=torch.float64, device=current_device())
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            needed = float(agreed.item())
        return needed <= self.budget_s


def _tokens_per_step(config) -> int:
    return config.train.global_batch_size * config.model.seq_length


def _variant_runs(variant: str, curves: list[dict[int, float]], config) -> VariantRuns:
    from t2train.bench.compare_report import VariantRuns
    from t2train.model.flops import parameters, train_flops_per_token
    from t2train.train.inputs import dataset_facts

    vocab_size = config.padded_vocab_size(dataset_facts(config)["vocab_size"])
    return VariantRuns(
        variant,
        curves,
        _tokens_per_step(config),
        train_flops_per_token(config.model, vocab_size),
        parameters(config.model, vocab_size),
    )


def _context(batch: Batch, argv: list[str]) -> list[str]:
    """How the numbers were measured, for the top of ``compare.md``."""
    from t2train.data.index import read_index
    from t2train.model.build import compute_dtype

    config = batch.configs[batch.variants[0], batch.seeds[0]]
    train_cfg, tokens = config.train, _tokens_per_step(config)
    split = read_index(config.data.path).get("val_split", {"by": "sample"})
    if split["by"] == "file":
        held = ", ".join(Path(path).name for path in split["files"])
        validation = f"whole files held out of training ({held})"
    else:
        validation = (
            "samples drawn at random from the same files as the training text (not held-out text)"
        )
    seeds = ", ".join(map(str, batch.seeds))
    dtype = str(compute_dtype(config)).removeprefix("torch.")
    return [
        f"command: `{shlex.join(['t2train', *argv])}`",
        f"dataset: `{config.data.path}`; validation split: {validation}",
        f"each evaluation: the first {train_cfg.eval_batches} x "
        f"{train_cfg.global_batch_size} x {config.model.seq_length} = "
        f"{train_cfg.eval_batches * tokens} tokens of the validation split, every "
        f"{train_cfg.eval_interval} steps",
        f"each run: {batch.steps} steps x {train_cfg.global_batch_size} sequences x "
        f"{config.model.seq_length} tokens = {batch.steps * tokens} tokens; "
        f"seeds {seeds}; runs: {len(batch.configs)}; model: {config.model.num_layers} "
        f"layers, hidden {config.model.hidden_size}, {dtype}",
    ] + (
        [
            f"not finished yet, so not in the tables: {len(batch.missing)} run(s) "
            f"({', '.join(batch.missing)})"
        ]
        if batch.missing
        else []
    )


def _cmd_compare(args) -> int:
    from t2train.bench.compare_figures import write_figures
    from t2train.bench.compare_report import equal_flops_budget, format_report
    from t2train.bench.variants import variant_names
    from t2train.parallel.init import is_rank_zero
    from t2train.residual import BASELINE
    from t2train.signals import REQUEUE_EXIT_CODE

    seeds = [args.first_seed + index for index in range(args.seeds)]
    out = Path(args.out)
    budget_s = None if args.time_budget_min is None else 60 * args.time_budget_min
    batch = Batch(
        args.preset,
        args.config,
        args.overrides,
        variant_names(args.designs),
        seeds,
        args.steps,
        out,
        train_missing=not args.report_only,
        budget_s=budget_s,
    )
    started = time.monotonic()
    results = batch.run()
    if not is_rank_zero():
        return REQUEUE_EXIT_CODE if batch.stopped else 0
    done = (
        f"{batch.trained} run(s) trained or resumed, {batch.read} finished earlier, in "
        f"{time.monotonic() - started:.0f}s"
    )
    if batch.stopped:
        print(
            f"batch stopped: {batch.stopped}; {done}. Run the same command again to resume "
            f"the batch (exit code {REQUEUE_EXIT_CODE})"
        )
        return REQUEUE_EXIT_CODE
    if batch.missing:
        why = "--report-only" if args.report_only else f"--time-budget-min={args.time_budget_min:g}"
        print(
            f"not run ({why}): {len(batch.missing)} of {len(batch.configs)} run(s): "
            f"{', '.join(batch.missing)}"
        )
    if BASELINE not in [runs.variant for runs in results]:
        print(f"{done}; no report yet: the baseline `{BASELINE}` has no finished run in {out}")
        return 0
    figures = write_figures(results, equal_flops_budget(results), out)
    report = format_report(results, BASELINE, _context(batch, sys.argv[1:]), figures)
    (out / "compare.md").write_text(report)
    print(report + f"\n{done}; report {out / 'compare.md'}, figures beside it")
    return 0


def register(commands) -> None:
    from t2train.config.arguments import add_config_arguments

    experiment = commands.add_parser("experiment", help="experiments across residual designs")
    tools = experiment.add_subparsers(dest="experiment_command", required=True)
    compare = tools.add_parser(
        "compare",
        help="validation loss per variant at equal tokens and equal FLOPs, over seeds; resumable",
        description="Train each variant for each seed on the same tokens, evaluating every "
        "train.eval_interval steps (default: steps/10), and write OUT/compare.md "
        "(validation loss at equal tokens and at equal training FLOPs: mean, "
        "std, min-max over seeds, difference from the baseline and the error of that "
        "difference) and two PNG figures beside it; TensorBoard runs under OUT. Run the "
        "same command again to resume an interrupted batch: finished runs are "
        "read, unfinished ones resume from their checkpoints.",
    )
    add_config_arguments(compare)
    compare.add_argument(
        "--designs",
        help="comma-separated variants: a design alone or with "
        "the local mixer (<design>, <design>+<mixer>), "
        "optionally with model options of its own after "
        "colons (<design>:model.<section>.<option>=<value>); "
        "default: every registered design alone",
    )
    compare.add_argument("--seeds", type=int, default=3, help="seeds per design (default 3)")
    compare.add_argument(
        "--first-seed", type=int, default=1234, help="seeds are FIRST, FIRST+1, ... (default 1234)"
    )
    compare.add_argument("--steps", type=int, required=True, help="training steps per run")
    compare.add_argument(
        "--out", required=True, help="directory for the runs, compare.md and the figures"
    )
    compare.add_argument(
        "--time-budget-min",
        type=float,
        help="start a run only while the slowest run so far still ends within "
        "this many minutes of the command's start (a batch completed "
        "over several short machine loans); the report covers the runs "
        "finished so far",
    )
    compare.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: report the runs finished in OUT so far and list the missing ones",
    )
    compare.set_defaults(handler=_cmd_compare)
