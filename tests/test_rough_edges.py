"""User-facing rough edges, each with a fast check: an import's tokenizer found from any
directory, `eval --tasks` without the Hub (one error line) and without library noise (its own
stage lines), a SentencePiece-only tokenizer folder converted, a CPU profile without the
profiler backend's console lines, and `load_model` leaving the environment as it was."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from t2train.cli import main

WORDS = "the a to of and in is it you that he was for on are".split()


@pytest.fixture(scope="module")
def imported(megatron_world, tmp_path_factory) -> Path:
    """``t2train import hf`` of a one-layer Llama (hidden 32) with a word-level tokenizer made
    here: the cheapest import (about a second)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    from t2train.export.hf_import import import_hf

    root = tmp_path_factory.mktemp("import")
    vocab = ["<|endoftext|>", "[UNK]", *WORDS]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
        )
    )
    llama.save_pretrained(root / "llama")
    tokenizer.save(str(root / "llama" / "tokenizer.json"))
    import_hf(root / "llama", root / "imported")
    return root / "imported"


def test_an_imports_tokenizer_is_found_from_any_directory(imported, tmp_path, monkeypatch):
    """An import records no dataset (data.path is empty): its tokenizer is OUT/tokenizer.json,
    found from the checkpoint, not from the current directory (export hf, generate and eval
    all look it up so), also once the folder has moved."""
    from t2train.data.errors import DataError
    from t2train.export.load import open_checkpoint
    from t2train.export.tokenizer import run_tokenizer

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    given = os.path.relpath(imported, elsewhere)  # as `t2train export hf ../imported OUT`
    assert run_tokenizer(open_checkpoint(given)).path == Path(given) / "tokenizer.json"
    moved = tmp_path / "moved"
    shutil.copytree(imported, moved)
    assert run_tokenizer(open_checkpoint("../moved")).tokenizer.token_to_id("he") is not None
    (moved / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"tokenizer \.\./moved/tokenizer.json: not found; an impo"):
        run_tokenizer(open_checkpoint("../moved"))


def _local_tasks(monkeypatch, folder: Path, **task) -> None:
    """An lm-eval task YAML in ``folder``, and lm-eval's index of only that folder (its own
    thousands of tasks take seconds to index)."""
    from lm_eval import tasks

    folder.mkdir()
    (folder / f"{task['task']}.yaml").write_text(
        yaml.safe_dump(
            {
                "output_type": "multiple_choice",
                "test_split": "test",
                "doc_to_text": "{{question}}",
                "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{answer}}",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                **task,
            }
        )
    )
    monkeypatch.setattr(
        tasks, "TaskManager", functools.partial(tasks.TaskManager, include_defaults=False)
    )


def test_tasks_whose_data_cannot_be_fetched_end_in_one_error_line(
    imported, tmp_path, monkeypatch, capsys
):
    """Without the Hub, datasets raises ConnectionError("Couldn't reach '<dataset>' on the Hub
    (...)") when lm-eval builds the task: one error line naming it and how to use a local
    copy, exit code 2, after the stage lines."""
    pytest.importorskip("lm_eval")
    import datasets

    _local_tasks(monkeypatch, tmp_path / "tasks", task="t2_hub", dataset_path="Rowan/hellaswag")

    def unreachable(path, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    argv = ["eval", str(imported), "--tasks", "t2_hub", "--include-path", str(tmp_path / "tasks")]
    assert main([*argv, "--device", "cpu"]) == 2
    *stages, error = capsys.readouterr().err.splitlines()
    assert all(line.startswith("eval [") for line in stages), stages
    assert error == (
        "error: --tasks t2_hub: their data cannot be fetched (Couldn't reach 'Rowan/hellaswag' "
        "on the Hub (LocalEntryNotFoundError)); run once where the Hub is reachable and copy "
        "its Hugging Face cache (HF_HOME, default ~/.cache/huggingface) here, then "
        "HF_HUB_OFFLINE=1 reads the data from it; or give --include-path a task YAML whose "
        "dataset_path is a local folder of the data files"
    )


def test_eval_tasks_reports_its_stages_and_no_library_noise(imported, tmp_path, monkeypatch, capfd):
    """stderr holds t2train's stage lines only: no progress bars of lm-eval or datasets, no
    "fatal: not a git repository" of lm-eval's `git describe` (run here outside a repository;
    capfd sees what subprocesses write)."""
    pytest.importorskip("lm_eval")
    docs = [
        {"question": "the a to", "choices": ["of", "and", "in"], "answer": 0},
        {"question": "it you", "choices": ["that", "he"], "answer": 1},
    ]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    _local_tasks(
        monkeypatch,
        tmp_path / "tasks",
        task="t2_choice",
        dataset_path="json",
        dataset_kwargs={"data_files": {"test": str(data)}},
    )
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    argv = ["eval", str(imported), "--tasks", "t2_choice", "--include-path", "tasks"]
    assert main([*argv, "--device", "cpu"]) == 0
    out, err = capfd.readouterr()
    assert "t2_choice" in out
    checkpoint = imported / "checkpoints" / "step_00000000"
    assert re.sub(r"\[\d+:\d\d\]", "[T]", err).splitlines() == [
        f"eval [T]: loading {checkpoint}",
        "eval [T]: reading the data of t2_choice (from the Hugging Face Hub unless cached)",
        "eval [T]: answering 5 log-likelihood requests",
    ]


def test_a_folder_with_only_a_sentencepiece_model_is_converted(tmp_path):
    """As Llama 2's and Mistral's tokenizer.model alone: converted to the fast tokenizer that
    encodes as SentencePiece does, with its <s> before each document and </s> between them."""
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("transformers")
    import io

    from t2train.data.prepare import prepare_dataset
    from t2train.data.tokenizer import default_bos_id, eos_id, load_tokenizer

    lines = [
        "The quick brown fox jumps over the lazy dog.",
        "Pack my box with five dozen liquor jugs!",
        "How vexingly quick daft zebras jump; 12 or 34 times?",
    ] * 10
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(  # Llama's settings: BPE, text as is
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=100,
        model_type="bpe",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    folder = tmp_path / "spm"  # no model name in it: AutoTokenizer guesses the class by those
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    theirs = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))

    ours = load_tokenizer(folder)
    for text in ["The lazy dog.", " two  spaces", "jump\nover 1234"]:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text), text
    assert (eos_id(ours), default_bos_id(ours)) == (theirs.eos_id(), theirs.bos_id())

    (tmp_path / "text.txt").write_text("\n".join(lines))
    index = prepare_dataset([str(tmp_path / "text.txt")], tmp_path / "data", 8, tokenizer=folder)
    assert (index["bos_id"], index["eos_id"]) == (theirs.bos_id(), theirs.eos_id())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the backend's lines are kept with CUDA")
def test_a_cpu_profile_prints_no_profiler_backend_lines(tmp_path):
    """torch.profiler's backend (Kineto) logs profiler_start, profiler_stop and "ERROR: ...
    gpuGetDeviceCount failed with code 35" to stderr at the process's first profile without
    CUDA; a profiled step keeps the console clean. In a fresh process: Kineto reads its log
    level once, at the first profile."""
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from t2train.config.loader import load_config\n"
        "from t2train.monitor.profiler import StepProfiler\n"
        "log = load_config(overrides=['data.path=unused', 'log.profile_steps=1']).log\n"
        "profiler = StepProfiler(log, Path(sys.argv[1]), 0)\n"
        "profiler.begin(1)\n"
        "torch.randn(8, 8) @ torch.randn(8, 8)\n"
        "profiler.end(1)\n"
        "print(*profiler.written)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{tmp_path / 'profile' / 'rank0.pt.trace.json'}\n"
    assert done.stderr == ""


def test_loading_a_checkpoint_leaves_the_environment_as_it_was(imported):
    """load_model's world of one sets RANK, MASTER_ADDR, MASTER_PORT, ... (and Megatron's model
    build NVTE_*): left set, a `t2train train` started from the same process (a notebook's
    `!t2train train`) took them as its launcher's and failed binding the port (EADDRINUSE).
    In a fresh process: this one's torch.distributed is already set up."""
    script = (
        "import json, os, sys\n"
        "from t2train.export.load import load_model, open_checkpoint\n"
        "before = dict(os.environ)\n"
        "load_model(open_checkpoint(sys.argv[1]), device='cpu')\n"
        "changed = set(before.items()) ^ set(os.environ.items())\n"
        "print(json.dumps(sorted(name for name, _ in changed)))\n"
    )
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    done = subprocess.run(
        [sys.executable, "-c", script, str(imported)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
