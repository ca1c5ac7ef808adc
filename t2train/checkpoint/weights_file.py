"""A model's weights as one plain state dict file, written by ``t2train ckpt convert``
(``t2train/export/state_dict.py``) and read by ``checkpoint.init_from``.

The folder ``t2train ckpt convert`` writes:

    model.pt | model.safetensors   {t2train parameter name: tensor} of the whole model at
                                   TP = PP = 1 (``torch.save``, or safetensors)
    t2train.yaml                   the run's config, as its checkpoint recorded it
    t2train_weights.json           where the weights come from (checkpoint, step), the format
                                   of t2train.yaml and the tokenizer's sha256
    t2train_checksums.json         each file's size and xxh3_64, as in a checkpoint

Only the weights file is needed to start a run from it: without the files beside it (a file
copied alone, or a state dict of the same names written elsewhere) its tensors are still
checked against the model, but its model config and tokenizer are not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from t2train.checkpoint.errors import CheckpointError
from t2train.checkpoint.paths import CHECKSUMS

if TYPE_CHECKING:
    import torch

FILES = {"torch": "model.pt", "safetensors": "model.safetensors"}  # --format: the file's name
SUFFIXES = {".pt": "torch", ".safetensors": "safetensors"}
CONFIG = "t2train.yaml"
RECORD = "t2train_weights.json"


def weights_file(path: Path) -> Optional[Path]:
    """The weights file ``path`` names: a ``.pt`` or ``.safetensors`` file, or the one in a
    folder ``t2train ckpt convert`` wrote; None for anything else (e.g. a checkpoint)."""
    if path.is_file():
        return path if path.suffix in SUFFIXES else None
    found = [path / name for name in FILES.values() if (path / name).is_file()]
    return found[0] if len(found) == 1 else None


def read_record(file: Path) -> dict:
    """What the folder of a weights file records beside it, as a checkpoint's train state
    has it (``config``, ``config_format``, ``tokenizer_sha256``, ...); {} for a file alone."""
    from t2train.config.loader import load_yaml_file  # noqa: PLC0415 - the config loader: not for `t2train ckpt --help`

    record_file = file.parent / RECORD
    if not record_file.is_file():
        return {}
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{record_file}: cannot read ({type(err).__name__}: {err})") from None
    if record.get("weights") != file.name:  # a file of another name put beside the record
        return {}
    return dict(record, config=load_yaml_file(str(file.parent / CONFIG)))


def is_verifiable(file: Path) -> bool:
    """Whether checksums of the weights file were recorded beside it (``t2train ckpt
    convert``'s folder): then ``integrity.require_intact(file.parent)`` checks them."""
    return (file.parent / CHECKSUMS).is_file()


def read_weights_file(file: Path) -> dict[str, torch.Tensor]:
    """The state dict in ``file`` (loaded as data only, on the host, memory-mapped from a torch
    file); a file that is not {name: tensor} is refused naming it."""
    import torch  # noqa: PLC0415 - torch: not for `t2train ckpt --help`

    try:
        if SUFFIXES[file.suffix] == "safetensors":
            from safetensors.torch import load_file  # noqa: PLC0415 - safetensors (the hf extra): safetensors files only

            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except ImportError:
        raise CheckpointError(
            f"{file}: reading safetensors needs safetensors: pip install 't2train[hf]'"
        ) from None
    except Exception as err:  # torch and safetensors raise many types for unreadable files
        lines = str(err).strip().splitlines()
        raise CheckpointError(
            f"{file}: cannot read it as a state dict ({type(err).__name__}: "
            f"{lines[0] if lines else ''})"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(name, str) and torch.is_tensor(tensor) for name, tensor in state.items()
    ):
        raise CheckpointError(
            f"{file}: not a plain state dict (expected a mapping of parameter names to "
            "tensors, as `t2train ckpt convert` writes)"
        )
    return state


def write_weights_file(state: dict[str, torch.Tensor], file: Path) -> None:
    """``state`` into ``file``, in the format its name says (``FILES``)."""
    if SUFFIXES[file.suffix] == "safetensors":
        from safetensors.torch import save_file  # noqa: PLC0415 - safetensors (the hf extra): safetensors files only

        save_file(state, str(file), metadata={"format": "pt"})  # as transformers writes them
    else:
        import torch  # noqa: PLC0415 - torch: not for `t2train ckpt --help`

        torch.save(state, file)
