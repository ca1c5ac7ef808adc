"""``t2train ckpt inspect PATH``: what a checkpoint holds, without loading its tensors;
``t2train ckpt verify PATH``: whether its files (or a ``t2train ckpt convert`` folder's) are
those written at save. ``ckpt convert`` loads the model: it is registered with the export
commands (``export/cli.py``).

PATH is a checkpoint directory, or a run directory, its ``checkpoints`` directory or its
``latest`` file, which stand for the newest complete checkpoint there.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.paths import CHECKSUMS, LATEST, is_complete
from t2train.checkpoint.train_state import read_train_state
from t2train.checkpoint.weights_file import is_verifiable, weights_file
from t2train.residual import resolve_aliases, variant_label


def resolve_checkpoint(path: Path) -> Path:
    """``path`` if it is a complete checkpoint, else the newest one it leads to."""
    from t2train.checkpoint.store import find_latest  # noqa: PLC0415 - torch and Megatron: not for `t2train ckpt --help`

    if path.name == LATEST and path.is_file():
        path = path.parent
    if is_complete(path):
        return path
    for root in (path / "checkpoints", path):
        found = find_latest(root) if root.is_dir() else None
        if found is not None:
            return found
    raise CheckpointError(
        f"{path}: not a complete t2train checkpoint, nor a run or checkpoints directory holding one"
    )


def describe(path: Path) -> str:
    state = read_train_state(path)
    model = state.get("config", {}).get("model", {})
    design = (
        variant_label(resolve_aliases(model, state.get("config_format", 1)))
        if "residual" in model
        else "?"
    )
    layout = state["layout"]
    files = sorted(p for p in path.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    lines = [
        f"checkpoint {path}",
        f"  step {state['step']}, tokens {state.get('tokens', 0):,}",
        f"  layout TP {layout['tp']} x PP {layout['pp']} x DP {layout['dp']}"
        + (f", DeepSpeed ZeRO-{layout['zero_stage']}" if "zero_stage" in layout else ""),
        f"  model {design} residual, {model.get('num_layers', '?')} "
        f"layers, hidden {model.get('hidden_size', '?')}",
        "  optimizer state: "
        + ("yes" if state["has_optimizer"] else "no (before the first update)"),
        f"  code {state.get('code_version', 'unknown')}",
        f"  files ({len(files)}, {total / 2**20:.2f} MiB):",
    ]
    width = max(len(p.name) for p in files)
    lines += [f"    {p.name:<{width}}  {p.stat().st_size / 2**20:9.3f} MiB" for p in files]
    return "\n".join(lines)


def _cmd_inspect(args) -> int:
    given = Path(args.path)
    path = resolve_checkpoint(given)
    if path != given:
        print(f"{given}: its newest complete checkpoint is {path}")
    print(describe(path))
    return 0


def _cmd_verify(args) -> int:
    """Exit 0 when every file matches the checksum recorded at save, 1 naming the first that
    does not."""

    from t2train.checkpoint.compatibility import check_shard_files  # noqa: PLC0415 - torch: not for `t2train ckpt --help`
    from t2train.checkpoint.integrity import ALGORITHM, verify_checksums  # noqa: PLC0415 - torch: not for `t2train ckpt --help`

    given = Path(args.path)
    weights = weights_file(given)
    if weights is not None and is_verifiable(weights):  # a folder of `t2train ckpt convert`
        path = weights.parent
    else:
        path = resolve_checkpoint(given)
        if path != given:
            print(f"{given}: its newest complete checkpoint is {path}")
    if not (path / CHECKSUMS).is_file() and "checksums" not in read_train_state(path):
        # dist-checkpointing (metadata.json) names every shard in torch DCP's index
        indexed = (path / "metadata.json").is_file()
        if indexed:
            check_shard_files(path)
        print(
            f"{path}: no checksums recorded (saved by an older t2train): its content cannot "
            "be checked"
            + (", its shard files are all there at their indexed sizes" if indexed else "")
        )
        return 0
    started = time.monotonic()
    damage = verify_checksums(path)
    if damage is not None:
        print(f"{path} is damaged: {damage}")
        return 1
    files = json.loads((path / CHECKSUMS).read_text())["files"]
    size = sum(entry["bytes"] for entry in files.values())
    print(
        f"{path}: intact, {len(files)} files ({size / 2**20:.2f} MiB) match the {ALGORITHM} "
        f"checksums recorded at save ({time.monotonic() - started:.1f}s)"
    )
    return 0


def register(commands):
    """``t2train ckpt`` and its tools; returns its subparsers, for the tools of higher layers."""
    ckpt = commands.add_parser("ckpt", help="checkpoint tools")
    tools = ckpt.add_subparsers(dest="ckpt_command", required=True)
    inspect = tools.add_parser(
        "inspect",
        help="print step, tokens, layout, residual design and size per shard file",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect.add_argument(
        "path",
        help="a checkpoint directory (runs/NAME/checkpoints/"
        "step_00000100), or a run directory, its checkpoints "
        "directory or its latest file (the newest there)",
    )
    inspect.set_defaults(handler=_cmd_inspect)
    verify = tools.add_parser(
        "verify",
        help="check every file against the checksums recorded when it was saved "
        "(exit 1 naming the first that differs)",
    )
    verify.add_argument(
        "path",
        help="a checkpoint, or what leads to the newest one (as for inspect), or the folder "
        "of `t2train ckpt convert`",
    )
    verify.set_defaults(handler=_cmd_verify)
    return tools
