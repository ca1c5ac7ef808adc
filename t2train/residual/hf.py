"""What a Hugging Face export asks of the residual package (``t2train export hf``).

* ``is_llama(model)``: the baseline design without the local mixer is the Llama
  architecture, which transformers loads with no code of ours;
* every other design and combination runs through ``hf_modeling.py``, copied next to the
  weights: ``config_fields(model)`` are the fields its config reads, ``modeling_designs()``
  the designs it implements.

Parameter names need no table per design: ``hf_modeling.py`` names a design's own
parameters as the training modules do (``attn_residual.beta_proj.weight``,
``layer_entry.linear_q.weight``, ``stream.final_query``); the exporter renames only the
shared Megatron parts (attention, MLP, norms, embedding, head).
"""

from __future__ import annotations

import ast
from dataclasses import asdict
from pathlib import Path

from t2train.residual import BASELINE, get_design, mixer, mixer_on

MODELING_FILE = Path(__file__).with_name("hf_modeling.py")


def is_llama(model) -> bool:
    """``model`` (a ``ModelConfig``) is a plain pre-norm Transformer: Llama's math."""
    return model.residual == BASELINE and not mixer_on(model)


def config_fields(model) -> dict:
    """The residual design, its options (its ``model.<section>``) and the local attention
    window (0 = off), as ``hf_modeling.T2TrainConfig`` reads them."""
    design = get_design(model.residual)
    options = asdict(getattr(model, design.section)) if design.section else {}
    return {"residual": model.residual, "residual_options": options,
            "local_window": getattr(model, mixer().section).window}


def modeling_designs() -> set[str]:
    """The keys of ``DESIGNS`` in ``hf_modeling.py`` (read from its source: importing it
    needs transformers)."""
    tree = ast.parse(MODELING_FILE.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "DESIGNS" for target in node.targets):
            return {key.value for key in node.value.keys}
    raise RuntimeError(f"{MODELING_FILE}: no DESIGNS table")
