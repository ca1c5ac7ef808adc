"""Checkpoints outside the trainer: Hugging Face export, generation, evaluation.

* the modeling file (``t2train/residual/hf_modeling.py`` with the designs' export parts,
  ``t2train/residual/<design>/hf.py``, and the functional modules they share with the
  trainer) and the Llama mapping give
  t2train's logits for every design alone and with the local mixer, with random non-trivial
  weights (fp32, within 1e-5), and a wrong mapping is seen; through the trainer's and
  transformers' KV caches and on batches padded on either side, every position gets its
  sequence's logits, and transformers' ``generate`` on left-padded prompts gives the
  trainer's own greedy tokens (each of these paths with a design of each kind of stream
  state, every design on some path: tests/variants.py);
* one 4-rank launch trains every design at TP = 2 x PP = 2 (and `depth_attn` under DeepSpeed
  ZeRO-3 at TP = 2 x DP = 2) and saves; each checkpoint is exported, loaded by transformers
  on the CPU (`standard` with no remote code), and its logits on a real batch equal
  t2train's own forward within 1e-5, the loaded weights reproduce the run's last validation
  loss, `generate` runs, the tokenizer encodes as the run's, and
  ``checkpoint.export_hf_on_finish`` wrote the same model; lm-eval scores the export with
  its own Hugging Face model as ``t2train eval --tasks`` scores the checkpoint;
* bad inputs (no or a malformed checkpoint, a missing shard, an unknown design or one without
  modeling code, a missing tokenizer or one of another hash, a dataset of another tokenizer,
  a non-empty OUT) stop with one line naming the cause, and a failed export leaves no OUT.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from t2train.checkpoint.errors import CheckpointError
from t2train.cli import main
from t2train.config.loader import load_config
from t2train.data.errors import DataError
from t2train.errors import UserInputError
from t2train.residual import registered

from torchrun_helper import run_torchrun
from variants import spread

SEQ = 32
BASE = [
    "data.path=unused",
    "model.num_layers=3",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=16",
]
MIXER = ["model.shortswa.window=4"]
DESIGNS = {  # every registered design, with non-default options where they matter
    "standard": ["model.residual=standard"],
    "ddl": ["model.residual=ddl"],
    "ddl_dv4": ["model.residual=ddl", "model.ddl.dv=4"],
    "depth_attn": ["model.residual=depth_attn", "model.depth_attn.window=2"],
    "attnres": ["model.residual=attnres"],
    "block_attnres": ["model.residual=block_attnres", "model.attnres.block_size=3"],
    "hc": ["model.residual=hc"],
    "hc_static": ["model.residual=hc", "model.hc.dynamic=false"],
    "mhc": ["model.residual=mhc", "model.mhc.expansion_rate=3", "model.mhc.sinkhorn_iterations=5"],
}
RANDOM_VARIANTS = {  # each alone and with the local mixer; GQA and untied embeddings
    **DESIGNS,
    **{f"{name}+mixer": [*options, *MIXER] for name, options in DESIGNS.items()},
    "standard_gqa_untied": ["model.num_query_groups=2", "model.tie_embeddings=false"],
    "attnres_gqa_untied": [
        "model.residual=attnres",
        "model.num_query_groups=2",
        "model.tie_embeddings=false",
    ],
}
# The paths beyond one forward (caches, padding, generation) run the variants of
# tests/variants.py's rule: each path a design of each kind of stream state, the mixer on one,
# every design on some path; and one grouped-query variant, in turn. `standard` alone exports
# as transformers' own Llama: on a path that tests the modeling file it runs with the mixer.
CACHE_AND_GENERATION_PATHS = [
    "trainer cache",
    "export cache",
    "padded batch",
    "padded generate",
    "batch generate",
]
GQA = ["standard_gqa_untied", "attnres_gqa_untied"]


def _path_variants(path: str, modeling_file: bool = False) -> list[str]:
    chosen = [v.replace("+shortswa", "+mixer") for v in spread(CACHE_AND_GENERATION_PATHS)[path]]
    gqa = GQA[CACHE_AND_GENERATION_PATHS.index(path) % len(GQA)]
    if modeling_file:
        chosen = ["standard+mixer" if v == "standard" else v for v in chosen]
        gqa = "attnres_gqa_untied"
    return list(dict.fromkeys(chosen)) + [gqa]


def test_every_registered_design_has_hugging_face_modeling():
    from t2train.residual.hf import modeling_designs

    assert modeling_designs() == set(registered())


def test_the_assembled_modeling_file_stands_alone(monkeypatch):
    """What export writes imports no t2train module and runs with t2train unimportable."""
    import ast
    import sys

    from t2train.residual.hf import modeling_source

    source = modeling_source()
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not {name for name in imported if name.startswith("t2train")}
    monkeypatch.setitem(sys.modules, "t2train", None)  # any t2train import now fails
    namespace = {"__name__": "modeling_t2train"}
    exec(compile(source, "modeling_t2train.py", "exec"), namespace)
    assert set(namespace["DESIGNS"]) == set(registered())


def test_parts_are_assembled_after_the_parts_they_import(monkeypatch):
    """``mhc``'s part uses ``hc``'s names: it follows it whatever the registry's order, and a
    cycle of parts is named."""
    from t2train.residual import hf

    in_order = [path.parent.name for path in hf.export_parts()]
    assert in_order.index("hc") < in_order.index("mhc")
    monkeypatch.setattr(hf, "registered", lambda: tuple(reversed(registered())))
    reordered = [path.parent.name for path in hf.export_parts()]
    assert reordered.index("hc") < reordered.index("mhc") and reordered != in_order
    namespace = {"__name__": "modeling_t2train"}
    exec(compile(hf.modeling_source(), "modeling_t2train.py", "exec"), namespace)
    assert set(namespace["DESIGNS"]) == set(registered())
    real = hf._parts_imported
    monkeypatch.setattr(hf, "_parts_imported", lambda path: real(path) or ["mhc"])
    with pytest.raises(RuntimeError, match="in a cycle: .*mhc -> hc -> mhc"):
        hf.export_parts()


def test_the_export_computes_with_the_trainers_functions():
    """Each design's math is written once: an export part defines no module-level function,
    and every function it takes from a functional module is one a training module calls."""
    import ast

    from t2train.residual import hf

    parts = set(hf.export_parts())

    def functional_imports(path: Path) -> set[tuple[str, str]]:
        return {
            (node.module, alias.name)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and hf._is_functional(node.module or "")
            for alias in node.names
        }

    trainer = set().union(
        *(
            functional_imports(path)
            for path in hf.PACKAGE.rglob("*.py")
            if path not in parts and path.name not in ("functional.py", "hf_modeling.py")
        )
    )
    taken = set()
    for part in parts:
        tree = ast.parse(part.read_text())
        assert [node.name for node in tree.body if isinstance(node, ast.FunctionDef)] == []
        taken |= functional_imports(part)
    assert taken, "no export part uses a functional module"
    assert {name for _, name in taken - trainer} == set()


def test_an_export_part_may_not_import_the_trainer(tmp_path, monkeypatch):
    """A part's other t2train imports would not resolve next to the weights: refused."""
    from t2train.residual import hf

    part = tmp_path / "standard_hf.py"
    part.write_text(
        '"""A part."""\nfrom t2train.residual.standard.layers import AdditiveResidual\n'
        'EXPORTED = {"standard": (AdditiveResidual, AdditiveResidual, None)}\n'
    )
    monkeypatch.setattr(hf, "export_parts", lambda: [part])
    with pytest.raises(RuntimeError, match="t2train.residual.standard"):
        hf.modeling_source()


def test_a_functional_module_may_import_only_torch(tmp_path, monkeypatch):
    """A functional module is copied into the file as it is: one that imports the trainer
    (here the kernel dispatch) is refused, naming the file and the import."""
    from t2train.residual import hf

    math = tmp_path / "functional.py"
    math.write_text(
        '"""Math."""\nimport torch\nfrom t2train.kernels.dispatch import route\n'
        "def double(x):\n    return 2 * x\n"
    )
    part = tmp_path / "hf.py"
    part.write_text(
        '"""A part."""\nfrom t2train.residual.toy.functional import double\n'
        'EXPORTED = {"toy": (double, double, None)}\n'
    )
    real = hf._module_path
    monkeypatch.setattr(
        hf, "_module_path", lambda m: math if m == "t2train.residual.toy.functional" else real(m)
    )
    monkeypatch.setattr(hf, "export_parts", lambda: [part])
    with pytest.raises(RuntimeError, match=r"functional.py: imports t2train.kernels.dispatch"):
        hf.modeling_source()
    math.write_text('"""Math."""\nimport torch\ndef double(x):\n    return 2 * x\n')
    assert "def double(x):" in hf.modeling_source()


# --- the math, with random weights (in-process, TP = 1) ---------------------------------------


def _t2train_model(overrides: list[str], vocab: int = 128):
    from t2train.model.build import build_model_chunks, transformer_config

    config = load_config(overrides=BASE + overrides)
    torch.manual_seed(0)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=vocab)
    with torch.no_grad():  # non-trivial everywhere, zero-initialised parameters included
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return config, model.eval()


def _hf_model(model_config, state: dict, vocab: int = 128):
    from transformers import LlamaForCausalLM

    from t2train.export.hf import hf_config
    from t2train.residual.hf import modeling_module

    config = hf_config(model_config, vocab, eos_id=0, dtype=torch.float32)
    cls = (
        LlamaForCausalLM
        if config.architectures == ["LlamaForCausalLM"]
        else modeling_module().T2TrainForCausalLM
    )
    model = cls(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == []
    assert missing == ([] if not model_config.tie_embeddings else ["lm_head.weight"])
    return model.eval()


def _tokens(vocab: int = 128, batch: int = 2, seq: int = 16):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", RANDOM_VARIANTS)
def test_modeling_file_matches_t2train(megatron_world, variant):
    from t2train.export.hf import hf_state_dict

    config, model = _t2train_model(RANDOM_VARIANTS[variant])
    hf = _hf_model(config.model, hf_state_dict(model.state_dict(), config.model))
    if variant.startswith("standard") and "mixer" not in variant:
        assert type(hf).__name__ == "LlamaForCausalLM"
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens, torch.arange(16).expand(2, 16), None)
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", _path_variants("trainer cache"))
def test_a_kv_cache_gives_the_logits_of_the_whole_sequence(megatron_world, variant):
    """A prefix, then 3 tokens, then one at a time through a ``KVCache`` give every position
    the logits of one forward over the whole sequence (fp32, 1e-5); greedy generation with the
    cache equals generation without it, past ``seq_length`` (the window slides) too."""
    from t2train.export.generate import generate
    from t2train.model.kv_cache import KVCache

    config, model = _t2train_model(RANDOM_VARIANTS[variant])
    tokens = _tokens(batch=2, seq=12)

    def at(start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end).expand(2, end - start)

    with torch.no_grad():
        whole = model(tokens, at(0, 12), None)
        cache = KVCache(2, config.model.seq_length)
        parts = [
            model(tokens[:, :5], at(0, 5), None, kv_cache=cache),
            model(tokens[:, 5:8], at(5, 8), None, kv_cache=cache),
        ]
        parts += [
            model(tokens[:, i : i + 1], at(i, i + 1), None, kv_cache=cache) for i in range(8, 12)
        ]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-5)

    prompt = tokens[0, :10].tolist()
    cached = generate(model, prompt, 9, 128, config.model.seq_length)
    assert cached == generate(model, prompt, 9, 128, config.model.seq_length, cache=False)
    assert len(cached) == 9


@pytest.mark.parametrize("variant", _path_variants("batch generate"))
def test_a_batch_of_prompts_generates_for_each_what_it_generates_alone(megatron_world, variant):
    """``generate_batch`` on prompts of 9, 2 and 5 tokens gives each the tokens ``generate``
    gives it alone: greedy with the cache and without it, past ``seq_length`` (9 + 9 tokens
    slide the window), with rows that end apart (at the end-of-text token, or at a stop that
    reads the tokens), and sampled (each row with its own generator of the seed)."""
    from t2train.export.generate import generate, generate_batch

    config, model = _t2train_model(RANDOM_VARIANTS[variant])
    prompts = [prompt.tolist() for prompt in _prompts([9, 2, 5])]
    context = config.model.seq_length
    first = generate(model, prompts[1], 1, 128, context)[0]  # the end of text for the 2nd row

    def stop(new: list[int]) -> bool:
        return len(new) >= 3 and new[-1] % 3 == 0

    lengths = {}
    for name, options in {
        "greedy": {},
        "without the cache": {"cache": False},
        "end of text": {"eos_id": first},
        "stop": {"stop": stop},
        "sampled": {"top_p": 0.9, "temperature": 1.5, "seed": 7},
    }.items():
        batched = generate_batch(model, prompts, 9, 128, context, **options)
        alone = [generate(model, prompt, 9, 128, context, **options) for prompt in prompts]
        assert batched == alone, name
        lengths[name] = [len(new) for new in batched]
    assert lengths["greedy"] == [9, 9, 9]
    assert lengths["end of text"][1] == 1 and max(lengths["end of text"]) > 1


def _prompts(lengths: list[int], vocab: int = 128) -> list[torch.Tensor]:
    """Token rows of these lengths, without token 0 (the padding, and the end of text)."""
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]


def _padded(rows: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` padded with 0 to one length, and the attention mask (1: a token)."""
    longest = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        where = slice(longest - len(row), longest) if left else slice(0, len(row))
        ids[i, where], mask[i, where] = row, 1
    return ids, mask


@pytest.mark.parametrize("variant", _path_variants("export cache"))
def test_the_export_gives_a_kv_cache_the_logits_of_the_whole_sequence(megatron_world, variant):
    """The exported model with transformers' ``DynamicCache`` (made from its config, as
    ``generate`` makes it): a prefix, then 3 tokens, then one at a time give every position
    the logits of one forward over the whole sequence (fp32, 1e-5)."""
    from transformers import DynamicCache

    from t2train.export.hf import hf_state_dict

    config, model = _t2train_model(RANDOM_VARIANTS[variant])
    hf = _hf_model(config.model, hf_state_dict(model.state_dict(), config.model))
    tokens = _tokens(batch=2, seq=12)
    with torch.no_grad():
        whole = hf(tokens, use_cache=False).logits
        cache = DynamicCache(config=hf.config)
        cuts = [0, 5, 8, 9, 10, 11, 12]
        parts = [
            hf(tokens[:, start:end], past_key_values=cache, use_cache=True).logits
            for start, end in zip(cuts, cuts[1:])
        ]
    assert cache.get_seq_length() == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", _path_variants("padded batch", modeling_file=True))
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_gives_each_row_its_own_logits(megatron_world, variant, side):
    """Rows of 12, 7 and 3 tokens padded to one length, with their attention mask: each real
    position gets the logits of its row run alone (fp32, 1e-5), through a cache too (the
    padded prompt, then two tokens one at a time)."""
    from transformers import DynamicCache

    from t2train.export.hf import hf_state_dict

    config, model = _t2train_model(RANDOM_VARIANTS[variant])
    hf = _hf_model(config.model, hf_state_dict(model.state_dict(), config.model))
    rows = _prompts([12, 7, 3])
    ids, mask = _padded(rows, left=side == "left")
    with torch.no_grad():
        padded = hf(ids, attention_mask=mask, use_cache=False).logits
        alone = [hf(row[None], use_cache=False).logits[0] for row in rows]
        for i in range(len(rows)):
            torch.testing.assert_close(padded[i][mask[i].bool()], alone[i], atol=1e-5, rtol=1e-5)
        if side == "right":
            return
        cache = DynamicCache(config=hf.config)
        hf(ids[:, :-2], attention_mask=mask[:, :-2], past_key_values=cache, use_cache=True)
        steps = [
            hf(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], past_key_values=cache).logits
            for i in (ids.shape[1] - 2, ids.shape[1] - 1)
        ]
    for i in range(len(rows)):
        torch.testing.assert_close(torch.cat(steps, dim=1)[i], alone[i][-2:], atol=1e-5, rtol=1e-5)


def test_the_export_refuses_a_mask_or_positions_it_cannot_follow(megatron_world):
    """An attention mask of the wrong length, the positions of packed documents and a cache
    other than transformers' dynamic one are refused naming what was expected; the positions
    it counts itself are accepted."""
    from transformers import StaticCache

    from t2train.export.hf import hf_state_dict

    config, model = _t2train_model(RANDOM_VARIANTS["ddl+mixer"])
    hf = _hf_model(config.model, hf_state_dict(model.state_dict(), config.model))
    tokens = _tokens(batch=2, seq=8)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"shape \(2, 7\); expected \(2, 8\)"):
            hf(tokens, attention_mask=torch.ones(2, 7, dtype=torch.long))
        packed = torch.arange(4).repeat(2).expand(2, 8)
        with pytest.raises(ValueError, match="packed documents are not supported"):
            hf(tokens, position_ids=packed)
        counted = hf(tokens, position_ids=torch.arange(8).expand(2, 8)).logits
        torch.testing.assert_close(counted, hf(tokens).logits, atol=0, rtol=0)
        static = StaticCache(config=hf.config, max_cache_len=16)
        with pytest.raises(ValueError, match="a StaticCache: .* DynamicCache"):
            hf(tokens, past_key_values=static)


@pytest.mark.parametrize("variant", _path_variants("padded generate"))
def test_generate_on_padded_prompts_gives_the_trainers_tokens(megatron_world, variant):
    """transformers' ``generate`` (greedy) on prompts of 9, 5 and 2 tokens padded on the left
    gives each prompt the tokens that t2train's own generation gives it alone, with the cache
    and without it."""
    from t2train.export.generate import generate
    from t2train.export.hf import hf_state_dict

    config, model = _t2train_model(RANDOM_VARIANTS[variant])
    hf = _hf_model(config.model, hf_state_dict(model.state_dict(), config.model))
    prompts = _prompts([9, 5, 2])
    ids, mask = _padded(prompts, left=True)
    new_tokens = 6
    outputs = [
        hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            use_cache=use_cache,
        )[:, ids.shape[1] :].tolist()
        for use_cache in (True, False)
    ]
    assert outputs[0] == outputs[1]
    for prompt, row in zip(prompts, outputs[0]):
        ours = generate(model, prompt.tolist(), new_tokens, 128, config.model.seq_length, eos_id=0)
        assert row[: len(ours)] == ours, (row, ours)
        assert set(row[len(ours) :]) <= {0}  # padding after the end of text


TRANSFORMERS5 = Path(sys.prefix) / "transformers5"  # `make install` puts transformers 5 there
LOAD_EXPORTS = Path(__file__).parent / "workers" / "load_exports.py"
# every stream and residual of the modeling file (with the mixer), tied and untied embeddings,
# and transformers' own Llama, tied and untied with grouped-query attention
ACROSS_VERSIONS = [
    *(name for name in RANDOM_VARIANTS if name.endswith("+mixer") and name != "hc_static+mixer"),
    "attnres_gqa_untied",
    "standard",
    "standard_gqa_untied",
]


def _folder(variant: str) -> str:
    """An export folder's name: transformers imports its modeling file under it."""
    return variant.replace("+", "_")


@pytest.mark.slow
def test_exports_compute_the_same_under_transformers_4_and_5(megatron_world, tmp_path):
    """Exports with random non-trivial weights, loaded by the environment's transformers 4
    here and by transformers 5 (``.venv/transformers5``) in a process that imports no
    t2train, through the same code (``workers/load_exports.py``): the logits of left-padded
    prompts agree within 1e-6 (fp32), ``generate``'s greedy tokens through the cache are the
    same, and transformers 5 warns of nothing deprecated."""
    import importlib.util

    import transformers
    from safetensors.torch import save_file

    from t2train.export.hf import hf_state_dict
    from t2train.residual.hf import modeling_source

    assert TRANSFORMERS5.is_dir(), f"{TRANSFORMERS5}: missing; `make install` puts it there"
    root = tmp_path / "exports"
    for variant in ACROSS_VERSIONS:
        config, model = _t2train_model(RANDOM_VARIANTS[variant])
        state = hf_state_dict(model.state_dict(), config.model)
        hf = _hf_model(config.model, state)
        folder = root / _folder(variant)
        hf.config.save_pretrained(folder)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        if hf.config.architectures != ["LlamaForCausalLM"]:
            (folder / "modeling_t2train.py").write_text(modeling_source())

    spec = importlib.util.spec_from_file_location("load_exports", LOAD_EXPORTS)
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    assert transformers.__version__.startswith("4.")
    ours = {_folder(variant): worker.run(root / _folder(variant)) for variant in ACROSS_VERSIONS}

    out = tmp_path / "five.pt"
    done = subprocess.run(
        [sys.executable, str(LOAD_EXPORTS), str(root), str(out)],
        env={**os.environ, "PYTHONPATH": str(TRANSFORMERS5), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Nothing a later 5.x may remove. torch's notice to torchao (imported by transformers when
    # installed: the fp8 extra) about registering its enums is neither transformers' nor ours.
    deprecated = [
        line
        for line in done.stderr.splitlines()
        if "deprecated" in line and "torch/utils/_pytree.py" not in line
    ]
    assert not deprecated, done.stderr
    five = torch.load(out)
    assert five["transformers"].startswith("5.")
    assert set(five["models"]) == set(ours)
    for variant, theirs in five["models"].items():
        torch.testing.assert_close(
            theirs["logits"], ours[variant]["logits"], atol=1e-6, rtol=1e-6, msg=variant
        )
        assert theirs["generated"].tolist() == ours[variant]["generated"].tolist(), variant


def test_a_wrong_mapping_is_seen(megatron_world):
    """Swapping SwiGLU's gate and up halves, or two query heads, changes the logits."""
    from t2train.export.hf import hf_state_dict

    config, model = _t2train_model(["model.num_query_groups=2"])
    tokens = _tokens()
    state = hf_state_dict(model.state_dict(), config.model)
    with torch.no_grad():
        right = _hf_model(config.model, state)(tokens).logits
        swapped = dict(state)
        gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
        swapped[gate], swapped[up] = state[up], state[gate]
        assert not torch.allclose(_hf_model(config.model, swapped)(tokens).logits, right)
        heads = dict(state)
        q = state["model.layers.0.self_attn.q_proj.weight"].view(4, 16, 64)
        heads["model.layers.0.self_attn.q_proj.weight"] = q[[1, 0, 2, 3]].reshape(64, 64)
        assert not torch.allclose(_hf_model(config.model, heads)(tokens).logits, right)


# --- refusals that need no weights ------------------------------------------------------------


def _fake_checkpoint(root: Path, overrides=(), residual=None, **state) -> Path:
    """A DeepSpeed-engine checkpoint directory holding only its summary file."""
    config = asdict(load_config(overrides=[*BASE, *overrides]))
    if residual is not None:
        config["model"]["residual"] = residual
    path = root / "checkpoints" / "step_00000001"
    path.mkdir(parents=True)
    (path / "t2train_engine.json").write_text(
        json.dumps(
            dict(
                {
                    "engine": "deepspeed",
                    "step": 1,
                    "layout": {"tp": 1, "pp": 1, "dp": 1},
                    "config": config,
                    "config_format": 2,
                    "has_optimizer": True,
                },
                **state,
            )
        )
    )
    return path


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_no_checkpoint_or_a_malformed_one_is_named(tmp_path, capsys):
    err = _one_line_error(capsys, ["export", "hf", str(tmp_path / "nothing"), str(tmp_path / "o")])
    assert "nothing: not a complete t2train checkpoint" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metadata.json").write_text("{not json")
    assert "metadata.json: cannot read" in _one_line_error(
        capsys, ["export", "hf", str(bad), str(tmp_path / "o")]
    )
    assert not (tmp_path / "o").exists()


def test_an_unknown_design_is_named(tmp_path, capsys):
    checkpoint = _fake_checkpoint(tmp_path / "run", residual="no_such_design")
    err = _one_line_error(capsys, ["export", "hf", str(checkpoint), str(tmp_path / "o")])
    assert "model.residual='no_such_design'" in err and str(checkpoint) in err


def test_a_design_without_modeling_code_is_named(tmp_path, capsys, monkeypatch):
    from t2train.residual import hf

    monkeypatch.setattr(hf, "modeling_designs", lambda: {"standard"})
    checkpoint = _fake_checkpoint(tmp_path / "run", ["model.residual=ddl"])
    err = _one_line_error(capsys, ["export", "hf", str(checkpoint), str(tmp_path / "o")])
    assert "model.residual='ddl' has no Hugging Face modeling code yet" in err


def test_a_missing_tokenizer_is_named_and_nothing_is_written(tmp_path, capsys):
    gone = tmp_path / "moved-dataset"
    checkpoint = _fake_checkpoint(tmp_path / "run", [f"data.path={gone}"])
    out = tmp_path / "out"
    err = _one_line_error(capsys, ["export", "hf", str(tmp_path / "run"), str(out)])
    assert f"tokenizer {gone}/tokenizer.json: not found" in err and "--tokenizer" in err
    assert not out.exists() and not out.with_name("out.tmp").exists()
    err = _one_line_error(capsys, ["generate", str(checkpoint), "--prompt", "hi"])
    assert "tokenizer.json: not found" in err


def test_a_non_empty_out_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    checkpoint = _fake_checkpoint(tmp_path / "run")
    err = _one_line_error(capsys, ["export", "hf", str(checkpoint), str(out)])
    assert "is not empty" in err and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"


def test_eval_refuses_a_dataset_of_another_tokenizer(tmp_path, capsys):
    from t2train.data.prepare import FORMAT, VERSION

    ours, theirs = "a" * 64, "b" * 64
    checkpoint = _fake_checkpoint(tmp_path / "run", tokenizer_sha256=ours)
    data = tmp_path / "other-data"
    data.mkdir()
    (data / "index.json").write_text(
        json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "seq_length": 16,
                "vocab_size": 300,
                "eos_id": 0,
                "token_dtype": "uint16",
                "splits": {"val": {}},
                "tokenizer": {"sha256": theirs},
            }
        )
    )
    err = _one_line_error(capsys, ["eval", str(checkpoint), "--data", str(data)])
    assert f"tokenizer sha256 {theirs}" in err and f"tokenizer sha256 {ours}" in err


# --- trained checkpoints of every design, saved at TP = 2 x PP = 2 -----------------------------


@pytest.fixture(scope="module")
def trained(shakespeare, tmp_path_factory):
    """{variant: {"checkpoint", "val_loss", "exported"}} from one 4-rank launch."""
    root = tmp_path_factory.mktemp("export-runs")
    return run_torchrun(
        "export_designs.py",
        4,
        ["--data", str(shakespeare), "--root", str(root)],
        root / "result.json",
        timeout=900,
    )


def _val_batch(data: Path, samples: int) -> torch.Tensor:
    from t2train.data.loader import StreamingWorld, TokenBatches

    batches = TokenBatches(
        data,
        "val",
        micro_batch_size=samples,
        seq_length=SEQ,
        world=StreamingWorld(0, 1, 0, 1),
        seed=0,
        shuffle=False,
        finite=True,
    )
    return next(iter(batches))["tokens"]


@pytest.mark.slow
def test_every_design_exports_to_transformers(trained, shakespeare, megatron_world, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from t2train.data.tokenizer import load_tokenizer
    from t2train.export.evaluate import evaluate
    from t2train.export.hf import export_hf
    from t2train.export.load import load_model, open_checkpoint

    assert set(trained) == {
        "standard",
        "ddl",
        "ddl_dv4",
        "depth_attn",
        "attnres",
        "block_attnres",
        "depth_attn-zero3",
        "ddl+shortswa",
    }
    tokens = _val_batch(shakespeare, 2)
    text = "To be, or not to be, that is the question:"
    run_ids = load_tokenizer(shakespeare / "tokenizer.json").encode(text).ids
    for variant, run in trained.items():
        out = tmp_path / variant
        stages = []
        export = export_hf(run["checkpoint"], out, max_shard_size="96KB", progress=stages.append)
        assert [stage.split(" ")[0] for stage in stages] == ["loading", "writing"], stages
        llama = variant == "standard"
        assert export.architecture == ("LlamaForCausalLM" if llama else "T2TrainForCausalLM")
        assert (out / "modeling_t2train.py").exists() != llama
        assert (out / "model.safetensors.index.json").exists()  # sharded above 96KB
        hf = AutoModelForCausalLM.from_pretrained(
            out, trust_remote_code=not llama, dtype=torch.float32
        ).eval()
        tokenizer = AutoTokenizer.from_pretrained(out)
        assert tokenizer(text).input_ids == run_ids, variant

        loaded = load_model(open_checkpoint(run["checkpoint"]), device="cpu")
        with torch.no_grad():
            ours = loaded.model(tokens, torch.arange(SEQ).expand(2, SEQ), None)
            theirs = hf(tokens).logits
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5, msg=variant)
        # The weights are the trained ones: the run's last validation loss (first 4 val samples).
        again = evaluate(loaded.model, shakespeare, "val", SEQ, batch_size=4, max_batches=1)
        assert again.tokens == 4 * SEQ
        assert abs(again.loss - run["val_loss"]) < 2e-5, (variant, again.loss, run["val_loss"])

        prompt = tokenizer(text, return_tensors="pt")
        generated = hf.generate(**prompt, max_new_tokens=4, do_sample=False)
        assert generated.shape == (1, len(run_ids) + 4)

        if run["exported"] is not None:  # checkpoint.export_hf_on_finish
            finished = AutoModelForCausalLM.from_pretrained(
                run["exported"], trust_remote_code=True, dtype=torch.float32
            ).eval()
            with torch.no_grad():
                torch.testing.assert_close(finished(tokens).logits, theirs, atol=0, rtol=0)
    assert sum(run["exported"] is not None for run in trained.values()) == 1


@pytest.mark.slow
def test_generate_and_eval_commands(trained, shakespeare, megatron_world, capsys):
    run_dir = Path(trained["ddl+shortswa"]["checkpoint"]).parents[1]
    texts = []
    for sampling in ([], ["--top-p", "0.9", "--seed", "3"], ["--temperature", "20", "--seed", "3"]):
        assert (
            main(
                [
                    "generate",
                    str(run_dir),
                    "--prompt",
                    "To be, or not",
                    "--max-new-tokens",
                    "6",
                    "--device",
                    "cpu",
                    *sampling,
                ]
            )
            == 0
        )
        texts.append(capsys.readouterr().out)
        assert texts[-1].startswith("To be, or not")
    assert texts[2] != texts[0]  # --temperature alone samples (nearly uniformly, at 20)
    assert (
        main(
            [
                "eval",
                str(run_dir),
                "--data",
                str(shakespeare),
                "--max-batches",
                "2",
                "--batch-size",
                "2",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert f"over {2 * 2 * SEQ:,} tokens (2 batches of up to 2 x {SEQ})" in line
    loss = float(line.split("loss ")[1].split(",")[0])
    perplexity = float(line.split("perplexity ")[1].split(" ")[0])
    assert abs(perplexity - math.exp(loss)) < 1e-3 * perplexity


def _lm_eval_task(folder: Path, name: str, docs: list[dict], **fields) -> None:
    """A task in lm-eval's own YAML format over a local JSON-lines file (no network)."""
    import yaml

    (folder / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    metrics = [
        {"metric": metric, "aggregation": "mean", "higher_is_better": True}
        for metric in fields.pop("metrics")
    ]
    task = {
        "task": name,
        "dataset_path": "json",
        "test_split": "test",
        "metric_list": metrics,
        "dataset_kwargs": {"data_files": {"test": str(folder / f"{name}.jsonl")}},
        **fields,
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(task))


@pytest.mark.slow
def test_lm_eval_tasks_score_as_computed_by_hand(
    trained, megatron_world, tmp_path, capsys, monkeypatch
):
    """`eval --tasks` on a ddl + ShortSWA checkpoint: a multiple-choice task's acc and
    acc_norm, and a generation task's exact_match, equal the same scores computed here from the
    model's logits with the formulas written out (log-likelihood of " " + choice after the
    question, divided by the choice's characters for acc_norm; greedy tokens until a
    newline)."""
    from types import SimpleNamespace

    from t2train.export.harness import RunModel
    from t2train.export.load import load_model, open_checkpoint
    from t2train.export.tokenizer import run_tokenizer

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    run_dir = Path(trained["ddl+shortswa"]["checkpoint"]).parents[1]
    checkpoint = open_checkpoint(run_dir)
    tok = run_tokenizer(checkpoint)
    model = load_model(checkpoint, device="cpu").model
    vocab = tok.tokenizer.get_vocab_size()

    def encode(text: str) -> list[int]:
        return tok.encode_prompt(text)

    @torch.no_grad()
    def log_probs(ids: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0, :, :vocab]
        return torch.log_softmax(logits.double(), dim=-1)

    def loglikelihood(context: str, continuation: str) -> float:
        whole, prefix = encode(context + continuation), encode(context)
        scores = log_probs(whole)
        return sum(float(scores[i - 1, whole[i]]) for i in range(len(prefix), len(whole)))

    questions = [
        ("To be, or not to be, that is the", ["question", "king", "lord"], 0),
        ("My lord, I", ["will", "horse", "the"], 0),
        ("What is", ["he", "the"], 1),
        ("Good my lord,", ["give", "what", "sword", "I"], 3),
        ("The king is", ["dead", "come", "not"], 2),
    ]
    acc = acc_norm = 0.0
    for question, choices, answer in questions:
        scores = [loglikelihood(question, " " + choice) for choice in choices]
        per_char = [score / len(choice) for score, choice in zip(scores, choices)]  # lm-eval's
        acc += (max(range(len(choices)), key=scores.__getitem__) == answer) / len(questions)
        acc_norm += (max(range(len(choices)), key=per_char.__getitem__) == answer) / len(questions)
        # the adapter's own log-likelihoods, request by request (batched, padded on the right)
        requests = [SimpleNamespace(args=(question, " " + choice)) for choice in choices]
        adapter = RunModel(SimpleNamespace(model=model, checkpoint=checkpoint), tok, 2)
        for (theirs, _), ours in zip(adapter.loglikelihood(requests, disable_tqdm=True), scores):
            assert abs(theirs - ours) < 1e-4, (question, theirs, ours)

    prompts = ["To be, or not to be", "My lord,", "O, what a"]
    greedy = []
    for prompt in prompts:
        ids = encode(prompt)
        for _ in range(5):
            ids.append(int(log_probs(ids)[-1].argmax()))
        greedy.append(tok.tokenizer.decode(ids[len(encode(prompt)) :]).split("\n")[0])
    targets = [greedy[0], greedy[1] + " and more", greedy[2]]  # 2 of 3 match
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _lm_eval_task(
        tasks,
        "t2_choice",
        [{"question": q, "choices": c, "answer": a} for q, c, a in questions],
        output_type="multiple_choice",
        doc_to_text="{{question}}",
        doc_to_choice="{{choices}}",
        doc_to_target="{{answer}}",
        metrics=["acc", "acc_norm"],
    )
    _lm_eval_task(
        tasks,
        "t2_continue",
        [{"prompt": p, "target": t} for p, t in zip(prompts, targets)],
        output_type="generate_until",
        doc_to_text="{{prompt}}",
        doc_to_target="{{target}}",
        metrics=["exact_match"],
        generation_kwargs={"until": ["\n"], "max_gen_toks": 5, "do_sample": False},
    )
    out = tmp_path / "scores.json"
    assert (
        main(
            [
                "eval",
                str(run_dir),
                "--tasks",
                "t2_choice,t2_continue",
                "--include-path",
                str(tasks),
                "--device",
                "cpu",
                "--batch-size",
                "3",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert "t2_choice" in capsys.readouterr().out
    scores = json.loads(out.read_text())["results"]
    assert scores["t2_choice"]["acc,none"] == pytest.approx(acc)
    assert scores["t2_choice"]["acc_norm,none"] == pytest.approx(acc_norm)
    assert scores["t2_continue"]["exact_match,none"] == pytest.approx(2 / 3)

    # The export, under lm-eval's own Hugging Face model: batched, its generation on prompts
    # padded on the left through transformers' cache.
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from t2train.export.hf import export_hf

    exported = tmp_path / "exported"
    export_hf(run_dir, exported)
    hf_scores = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(exported), "trust_remote_code": True, "dtype": "float32"},
        tasks=["t2_choice", "t2_continue"],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=3,
        device="cpu",
    )["results"]
    for task, metric in [
        ("t2_choice", "acc"),
        ("t2_choice", "acc_norm"),
        ("t2_continue", "exact_match"),
    ]:
        assert hf_scores[task][f"{metric},none"] == pytest.approx(scores[task][f"{metric},none"])
    capsys.readouterr()  # lm-eval's progress bars

    err = _one_line_error(
        capsys,
        [
            "eval",
            str(run_dir),
            "--tasks",
            "no_such_task",
            "--include-path",
            str(tasks),
            "--device",
            "cpu",
        ],
    )
    assert "no_such_task" in err and "--tasks" in err


@pytest.mark.slow
def test_a_broken_checkpoint_or_a_failed_write_leaves_no_out(
    trained, megatron_world, tmp_path, monkeypatch
):
    from t2train.export import hf as exporter

    original = Path(trained["ddl"]["checkpoint"])
    broken = tmp_path / "broken" / original.name
    shutil.copytree(original, broken)
    shard = sorted(broken.glob("*.distcp"))[0]
    shard.unlink()
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=f"{broken} is damaged: {shard}: missing"):
        exporter.export_hf(broken, out)
    assert not out.exists()

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(exporter, "_tokenizer", fail)
    with pytest.raises(OSError, match="No space left"):
        exporter.export_hf(original, out)
    assert not out.exists() and not (tmp_path / "out.tmp").exists()
    with pytest.raises(UserInputError):  # and the refusals keep their type for the CLI
        exporter.export_hf(original, out, tokenizer=tmp_path / "missing.json")
    assert not out.exists()


def test_a_tokenizer_of_another_hash_is_refused(tmp_path):
    from t2train.data.tokenizer import save_tokenizer, train_tokenizer
    from t2train.export.load import open_checkpoint
    from t2train.export.tokenizer import run_tokenizer

    data = tmp_path / "data"
    data.mkdir()
    save_tokenizer(train_tokenizer(["to be or not to be"] * 4, 260), data)
    checkpoint = _fake_checkpoint(
        tmp_path / "run", [f"data.path={data}"], tokenizer_sha256="c" * 64
    )
    with pytest.raises(DataError, match="but the run was trained with tokenizer cccccccccccc"):
        run_tokenizer(open_checkpoint(checkpoint))


def test_conversions_report_each_stage_on_stderr(capsys):
    from t2train.export.cli import StageLine

    StageLine("export hf")("writing 2.56M parameters to out.tmp")
    assert capsys.readouterr().err == "export hf [0:00]: writing 2.56M parameters to out.tmp\n"


def test_eval_reports_progress_on_stderr(capsys):
    from t2train.export.cli import ProgressLine

    report = ProgressLine("eval val", total=40, every=0)
    report(10)
    line = capsys.readouterr().err
    assert line.startswith("eval val: 10/40 batches, 0:00 elapsed, eta 0:0")
    assert line.count("\n") == 1


def test_a_prompt_starts_as_the_runs_documents_did(tmp_path):
    """``t2train generate`` encodes the prompt without the tokenizer's own special tokens and
    puts the begin token the run's dataset started documents with (its checkpoint's bos_id)
    in front, or none."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from t2train.export.tokenizer import RunTokenizer

    tokenizer = Tokenizer(
        models.WordLevel({"<s>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    run = RunTokenizer(tmp_path, "0" * 64, tokenizer, eos_id=3)
    assert run.encode_prompt("a b") == [1, 2]  # bos=never: not the tokenizer's default <s>
    assert RunTokenizer(tmp_path, "0" * 64, tokenizer, eos_id=3, bos_id=0).encode_prompt("a b") == [
        0,
        1,
        2,
    ]
