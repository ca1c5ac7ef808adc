"""``t2train experiment compare``: validation loss per residual design over several seeds.

Each (design, seed) trains through ``train(config)`` for the same steps, so the same tokens,
into its own run directory ``OUT/<design>-seed<N>`` (``tensorboard --logdir OUT`` shows them
side by side); the final validation loss on the held-out split is tabulated in
``OUT/compare.md``: mean and spread over seeds, with the token and FLOP budgets.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from t2train.bench.table import markdown_table


@dataclass
class DesignResult:
    design: str
    val_losses: list[float]  # final validation loss, one per seed
    tokens: int  # trained per run
    train_flops_per_token: float
    params: int


def _train_design(preset: Optional[str], config_file: Optional[str], overrides: list[str],
                  design: str, seeds: list[int], steps: int, out: Path) -> DesignResult:
    from t2train.bench.variants import variant_config
    from t2train.model.build import padded_vocab_size
    from t2train.model.flops import parameters, train_flops_per_token
    from t2train.train.loop import dataset_facts, train

    losses = []
    for seed in seeds:
        config = variant_config(
            preset, config_file, [f"train.eval_interval={steps}", *overrides], design,
            f"train.seed={seed}", f"train.steps={steps}",
            f"log.run_dir={out / f'{design}-seed{seed}'}", "checkpoint.resume=none",
            "checkpoint.overwrite=true")
        summary = train(config)
        losses.append(summary.val_losses[summary.final_step])
    vocab_size = padded_vocab_size(dataset_facts(config)["vocab_size"], config)
    return DesignResult(design, losses,
                        steps * config.train.global_batch_size * config.model.seq_length,
                        train_flops_per_token(config.model, vocab_size),
                        parameters(config.model, vocab_size))


def run_compare(preset: Optional[str], config_file: Optional[str], overrides: list[str],
                designs: list[str], seeds: list[int], steps: int,
                out: Path) -> list[DesignResult]:
    return [_train_design(preset, config_file, overrides, design, seeds, steps, out)
            for design in designs]


def format_compare_table(results: list[DesignResult]) -> str:
    headers = ["design", "seeds", "mean val loss", "std", "min-max", "tokens",
               "train FLOPs/token", "total train FLOPs", "params (M)"]
    rows = []
    for result in results:
        losses = result.val_losses
        std = statistics.stdev(losses) if len(losses) > 1 else 0.0
        rows.append([result.design, str(len(losses)), f"{statistics.mean(losses):.4f}",
                     f"{std:.4f}", f"{min(losses):.4f}-{max(losses):.4f}", str(result.tokens),
                     f"{result.train_flops_per_token:.3e}",
                     f"{result.train_flops_per_token * result.tokens:.3e}",
                     f"{result.params / 1e6:.2f}"])
    return markdown_table(headers, rows)


def _cmd_compare(args) -> int:
    from t2train.bench.variants import variant_names
    from t2train.parallel.init import is_rank_zero

    designs = variant_names(args.designs)
    seeds = [args.first_seed + index for index in range(args.seeds)]
    out = Path(args.out)
    results = run_compare(args.preset, args.config, args.overrides, designs, seeds, args.steps,
                          out)
    if is_rank_zero():
        table = format_compare_table(results)
        (out / "compare.md").write_text(table + "\n")
        print(table)
    return 0


def register(commands) -> None:
    from t2train.config.arguments import add_config_arguments

    experiment = commands.add_parser("experiment", help="experiments across residual designs")
    tools = experiment.add_subparsers(dest="experiment_command", required=True)
    compare = tools.add_parser(
        "compare", help="final validation loss per design, mean and spread over seeds",
        description="Train each design for each seed on the same tokens and tabulate the "
                    "final validation loss in OUT/compare.md (TensorBoard runs under OUT).")
    add_config_arguments(compare)
    compare.add_argument("--designs", help="comma-separated designs, each alone or with the "
                                           "local mixer: ddl,ddl+shortswa (default: every "
                                           "registered design alone)")
    compare.add_argument("--seeds", type=int, default=3, help="seeds per design (default 3)")
    compare.add_argument("--first-seed", type=int, default=1234,
                         help="seeds are FIRST, FIRST+1, ... (default 1234)")
    compare.add_argument("--steps", type=int, required=True, help="training steps per run")
    compare.add_argument("--out", required=True, help="directory for the runs and compare.md")
    compare.set_defaults(handler=_cmd_compare)
