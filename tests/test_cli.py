"""The `t2train` command: help text, and bad input failing fast without touching outputs."""

import subprocess
import sys
from pathlib import Path

import pytest


def t2train(*args, cwd: Path):
    return subprocess.run(
        [sys.executable, "-m", "t2train.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_help_lists_subcommands(tmp_path):
    proc = t2train("--help", cwd=tmp_path)
    assert proc.returncode == 0
    for command in ("train", "data", "config"):
        assert command in proc.stdout


def test_help_and_version_import_nothing_heavy(tmp_path):
    """--help and --version stay fast: building every command's parser imports no torch,
    Megatron, numpy or DeepSpeed (each of which takes seconds on a busy machine)."""
    check = (
        "import sys\n"
        "from t2train.cli import build_parser, main\n"
        "build_parser()\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "from t2train.compat.deferred_import import DeferredModule\n"
        "heavy = {'torch', 'megatron', 'numpy', 'deepspeed', 'streaming', 'transformers'}\n"
        "loaded = {name.split('.')[0] for name, module in sys.modules.items()\n"
        "          if not isinstance(module, DeferredModule)}  # stand-ins load nothing\n"
        "print(sorted(heavy & loaded))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    version, imported = proc.stdout.splitlines()
    assert version.startswith("t2train 0.1.0") and "torch 2." in version, version
    assert imported == "[]"


def test_config_only_commands_answer_without_torch(tmp_path):
    """``t2train config`` validates each design's options and rules, and ``t2train plan``
    plans its pipeline hops, from its declaration (``t2train/residual/<design>/__init__.py``);
    a misspelt key or a missing dataset in ``train`` and a refused ``import hf`` answer from
    the config (and the dataset's index) alone: none imports torch or Megatron-core (they took
    4 s of every config-only command on a busy machine)."""
    (tmp_path / "neox").mkdir()
    (tmp_path / "neox" / "config.json").write_text('{"architectures": ["GPTNeoXForCausalLM"]}')
    check = (
        "import contextlib, io, sys\n"
        "from t2train.cli import main\n"
        "from t2train.residual import registered\n"
        "for design in registered():\n"
        "    for window in (0, 4):\n"
        "        given = ['--preset', 'tiny', f'model.residual={design}',\n"
        "                 f'model.shortswa.window={window}']\n"
        "        out = io.StringIO()\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            code = main(['config', *given])\n"
        "        assert code == 0 and f'residual: {design}' in out.getvalue(), design\n"
        "        out = io.StringIO()\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            code = main(['plan', *given, 'model.num_layers=8', 'parallel.pipeline=2',\n"
        "                         'parallel.virtual_pipeline=2'])\n"
        "        assert code == 0 and 'units per hop' in out.getvalue(), design\n"
        "for argv, said in ((['train', '--preset', 'tiny', 'data.path=d', 'model.layerz=2'],\n"
        "                    'model.layerz: unknown field'),\n"
        "                   (['train', '--preset', 'tiny', 'data.path=no/such/dir'],\n"
        "                    'dataset no/such/dir: no such directory'),\n"
        "                   (['import', 'hf', 'neox', 'out'], 'GPTNeoX')):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        assert main(argv) == 2 and said in err.getvalue(), err.getvalue()\n"
        "from t2train.compat.deferred_import import DeferredModule\n"
        "heavy = {'torch', 'megatron', 'deepspeed', 'streaming', 'transformers'}\n"
        "loaded = {name.split('.')[0] for name, module in sys.modules.items()\n"
        "          if not isinstance(module, DeferredModule)}\n"
        "print(sorted(heavy & loaded))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[]"


def test_train_help_explains_overrides_and_lists_every_section(tmp_path):
    from dataclasses import fields

    from t2train.config.schema import Config

    proc = t2train("train", "--help", cwd=tmp_path)
    assert proc.returncode == 0
    assert "--preset" in proc.stdout and "model.num_layers=4" in proc.stdout
    assert "name=RUN" in proc.stdout and "log.run_dir" in proc.stdout
    sections = [f.name for f in fields(Config) if f.name != "name"]
    assert f"config sections: {', '.join(sections)}" in proc.stdout


@pytest.mark.parametrize(
    "args, cause",
    [
        (["--preset", "huge", "data.path=d"], "preset='huge': unknown preset"),
        (["--preset", "tiny", "data.path=d", "model.num_layers=-1"], "model.num_layers=-1"),
        (
            ["--preset", "tiny", "data.path=d", "model.layers=2"],
            "model.layers: unknown field; did you mean model.num_layers?",
        ),
        (["--preset", "tiny", "data.path=no/such/dir"], "no/such/dir"),
    ],
)
def test_bad_input_fails_fast_before_any_output(tmp_path, args, cause):
    proc = t2train("train", *args, "log.run_dir=runs/x", cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and cause in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "argv, usage",
    [
        (["train", "--presett", "tiny"], "t2train train"),
        (
            ["data", "prepare", "--corpus", "shakespeare", "--out", "x", "--inptu"],
            "t2train data prepare",
        ),
        (["export", "hf", "ckpt", "out", "--dtpye"], "t2train export hf"),
    ],
)
def test_a_misspelt_flag_shows_its_commands_usage(capsys, argv, usage):
    """argparse would print the top-level usage for a flag a subcommand does not know."""
    from t2train.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert err.startswith(f"usage: {usage} "), err
    assert f"{usage}: error: unrecognized arguments: --" in err, err


def test_config_prints_resolved_yaml(tmp_path):
    proc = t2train("config", "--preset", "tiny", "model.num_layers=2", cwd=tmp_path)
    assert proc.returncode == 0
    assert "num_layers: 2" in proc.stdout and "residual: standard" in proc.stdout
    assert proc.stderr == ""  # the libraries' known start-up warnings are silenced


def test_plan_prints_stages_and_hops(tmp_path):
    proc = t2train(
        "plan",
        "--preset",
        "tiny",
        "model.residual=attnres",
        "model.num_layers=8",
        "parallel.pipeline=4",
        "parallel.virtual_pipeline=2",
        "train.global_batch_size=32",
        "parallel.hop_shapes=padded",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "vocabulary 32,000 (--vocab-size default; training takes the dataset's)" in out
    assert (
        "lr schedule: cosine, warm-up 0 -> 3.00e-03 by step 30, decay to 3.00e-04 by step 300"
        in out
    )
    # a GPU run's precision (bf16) unless train.precision says otherwise
    assert "estimated, bfloat16 (train.precision=auto plans a GPU run" in out
    assert "each column is one rank's share of TP 1" in out and "params/rank" in out
    assert "one unit is one [seq 128 x micro-batch 8 x hidden 192] tensor = 384.0 KiB" in out
    assert "naive (every unit the next stages read): units per hop 3, 5, 7, 9, 11, 13, 15" in out
    assert "units per hop 3, 5, 7, 6, 6, 6, 6  <- in use (parallel.depth_cache=cached)" in out
    # 4 micro-batches x 45 data units x 384 KiB; padded: 7 hops x 7 units
    assert "data 58.5 MiB, on the wire 73.5 MiB (each hop padded to 7 units" in out
    for stage in range(4):  # weights, grads, optimizer, activations, depth cache, total
        assert (
            len(
                [
                    line
                    for line in out.splitlines()
                    if line.startswith(f"    {stage}  ") and line.count("iB") == 6
                ]
            )
            == 1
        )


def test_plan_without_anything_to_cache_says_so(tmp_path):
    proc = t2train(
        "plan",
        "--preset",
        "tiny",
        "model.residual=ddl",
        "parallel.pipeline=2",
        "model.vocab_size=5000",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "vocabulary 5,000 (model.vocab_size), padded to 5,120" in proc.stdout
    assert "ddl's units all change every layer: nothing to cache" in proc.stdout
    assert "cached" not in proc.stdout and "virtual stages" not in proc.stdout


def test_plan_refuses_impossible_layouts(tmp_path):
    proc = t2train("plan", "--preset", "tiny", "parallel.pipeline=3", cwd=tmp_path)
    assert proc.returncode == 2
    assert "model.num_layers=4: must be divisible by parallel.pipeline" in proc.stderr
    proc = t2train("plan", "--preset", "7b", "parallel.tensor=1", cwd=tmp_path)
    assert proc.returncode == 2
    assert "add the override parallel.sequence_parallel=false" in proc.stderr


def test_the_last_line_says_what_happened():
    from t2train.cli import _outcome
    from t2train.train.loop import RunSummary

    resumed = RunSummary(
        Path("runs/x"), start_step=320, final_step=400, val_losses={350: 4.95, 400: 4.9}
    )
    assert _outcome(resumed, 75) == (
        "done: step 400, val loss 4.9500 (step 350) -> 4.9000 "
        "(step 400), this run resumed at step 320; run dir runs/x"
    )
    once = RunSummary(Path("runs/x"), start_step=320, final_step=320, val_losses={320: 4.96})
    assert (
        _outcome(once, 75) == "done: step 320, val loss 4.9600 (step 320), this run "
        "resumed at step 320; run dir runs/x"
    )
    stopped = RunSummary(
        Path("runs/x"),
        start_step=0,
        final_step=34,
        val_losses={0: 8.34},
        checkpoint=Path("runs/x/checkpoints/step_00000034"),
        stopped="received SIGUSR1",
    )
    assert _outcome(stopped, 75) == (
        "stopped early at step 34 (received SIGUSR1): checkpoint runs/x/checkpoints/step_00000034"
        " saved; run the same command again to resume (exit code 75)"
    )


@pytest.mark.parametrize(
    "args, cause",
    [
        (["config", "--preset", "tiny", "data.path=no/such/dir"], "dataset no/such/dir: no such"),
        (
            ["train", "--preset", "tiny", "data.path=d", "modle.residual=ddl"],
            "modle: unknown field; did you mean model?",
        ),
        (
            [
                "train",
                "--preset",
                "tiny",
                "data.path=d",
                "model.seq_length=16",
                "parallel.tensor=2",
                "--dry-run",
            ],
            "must divide the world size 1; start 2 processes or more with `t2train launch "
            "--nproc-per-node=2 ...` (same arguments)",
        ),
    ],
)
def test_mistakes_say_what_to_do(megatron_world, tmp_path, monkeypatch, capsys, args, cause):
    from t2train.cli import main

    monkeypatch.chdir(tmp_path)
    if "parallel.tensor=2" in args:  # a real dataset, so the layout is what fails
        from t2train.data.prepare import prepare_dataset

        (tmp_path / "doc.txt").write_text("to be or not to be " * 200)
        prepare_dataset([str(tmp_path / "doc.txt")], tmp_path / "d", seq_length=16, vocab_size=300)
    assert main(args) == 2
    assert cause in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_dry_run_builds_everything_and_writes_nothing(
    megatron_world, shakespeare, tmp_path, capsys
):
    from t2train.cli import main

    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny",
                f"data.path={shakespeare}",
                "model.seq_length=64",
                "train.steps=20",
                "train.warmup_steps=2",
                "train.lr_decay_style=wsd",
                f"log.run_dir={run_dir}",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"dry run of {run_dir}: standard residual, 1.97M parameters on rank 0" in out, out
    assert "world 1 = TP 1 x PP 1 x DP 1 | engine megatron | fresh start" in out
    assert "20 steps of 1,024 tokens" in out and "one step's batches read" in out
    assert (
        "lr schedule: wsd, warm-up 0 -> 3.00e-03 by step 2, stable 3.00e-03 until step 16, "
        "linear decay to 3.00e-04 by step 20"
    ) in out
    assert "no pipeline hops (PP = 1)" in out
    assert out.rstrip().endswith(
        "nothing trained or written; to train, run the same command without --dry-run"
    )
    assert not run_dir.exists()
