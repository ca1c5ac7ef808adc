"""``t2train ckpt convert CHECKPOINT OUT``: a checkpoint's model weights as one plain state
dict, for tools that read ``torch.load`` or safetensors files, and for a run to start from
(``checkpoint.init_from=OUT``).

Any layout and either engine: the weights are read as ``t2train export hf`` reads them, into
one TP = PP = 1 model (``export/load.py``), and written under t2train's parameter names in the
checkpoint's dtype, the vocabulary's padding rows included. OUT's files are those of
``checkpoint/weights_file.py``. Everything is written into ``OUT.tmp`` and renamed to OUT at
the end; OUT, the format and the checkpoint are checked before any weight is read.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from t2train.checkpoint.weights_file import CONFIG, FILES, RECORD, write_weights_file
from t2train.errors import UserInputError
from t2train.export.folders import check_out, staged


@dataclass
class Converted:
    out: Path
    checkpoint: Path
    files: list[str]
    parameters: int


def convert_checkpoint(
    given: str | Path,
    out: str | Path,
    format: str = "torch",
    overwrite: bool = False,
    progress: Callable[[str], None] = lambda stage: None,
) -> Converted:
    """OUT from the checkpoint ``given`` leads to; ``progress`` hears each stage start."""
    from t2train.checkpoint.integrity import record_checksums
    from t2train.config.loader import config_from_dict, dump_config
    from t2train.config.schema import CONFIG_FORMAT
    from t2train.export.load import load_model, open_checkpoint
    from t2train.version import code_version

    out = Path(out)
    if format not in FILES:
        raise UserInputError(f"--format {format}: expected one of {', '.join(FILES)}")
    if format == "safetensors" and importlib.util.find_spec("safetensors") is None:
        raise UserInputError("--format safetensors needs safetensors: pip install 't2train[hf]'")
    check_out(out, overwrite)
    checkpoint = open_checkpoint(given)
    recorded = checkpoint.train_state
    # the run's own config; open_checkpoint's is the one-process model built to read it
    run_config = config_from_dict(recorded["config"], recorded.get("config_format", 1))
    progress(f"loading the weights of {checkpoint.path}")
    model = load_model(checkpoint, device="cpu").model
    state = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if not name.endswith("_extra_state")  # Transformer Engine's fp8 state, not weights
    }
    parameters = sum(tensor.numel() for tensor in state.values())
    with staged(out) as staging:
        progress(f"writing {parameters / 1e6:.2f}M parameters to {staging}")
        write_weights_file(state, staging / FILES[format])
        (staging / CONFIG).write_text(dump_config(run_config))
        record = {
            "weights": FILES[format],
            "format": format,
            "dtype": str(next(iter(state.values())).dtype).removeprefix("torch."),
            "parameters": parameters,
            "checkpoint": str(checkpoint.path.resolve()),
            "step": recorded.get("step"),
            "tokens": recorded.get("tokens"),
            "tokenizer_sha256": recorded.get("tokenizer_sha256"),
            "config_format": CONFIG_FORMAT,
            "code_version": code_version(),
        }
        (staging / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        record_checksums(staging)
    return Converted(out, checkpoint.path, sorted(p.name for p in out.iterdir()), parameters)
