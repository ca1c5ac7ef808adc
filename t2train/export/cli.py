"""The commands on a trained checkpoint: ``export hf``, ``ckpt convert``, ``generate``, ``eval``.

CHECKPOINT is a checkpoint directory, or a run directory, its ``checkpoints`` directory or
its ``latest`` file (the newest complete checkpoint there), of any layout and either engine.
"""

from __future__ import annotations

import argparse
import re

CHECKPOINT_HELP = (
    "a checkpoint directory, or a run directory (its newest complete checkpoint); "
    "any layout, either engine"
)
TOKENIZER_HELP = (
    "the run's tokenizer.json when its dataset (data.path) has moved; it must "
    "have the sha256 the checkpoint records"
)


def _label(checkpoint) -> str:
    from t2train.residual import variant_label

    return (
        f"step {checkpoint.train_state.get('step', '?')}, "
        f"{variant_label(checkpoint.config.model)} residual"
    )


def _cmd_export_hf(args) -> int:
    from t2train.export.hf import export_hf

    done = export_hf(
        args.checkpoint,
        args.out,
        tokenizer=args.tokenizer,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=StageLine("export hf"),
    )
    remote = ", trust_remote_code=True" if done.architecture != "LlamaForCausalLM" else ""
    print(
        f"exported {done.parameters / 1e6:.2f}M parameters as {done.architecture} to "
        f"{done.out} ({', '.join(done.files)})\n"
        f"load: AutoModelForCausalLM.from_pretrained({str(done.out)!r}{remote}); "
        f"AutoTokenizer.from_pretrained({str(done.out)!r})"
    )
    return 0


def _cmd_convert(args) -> int:
    from t2train.export.state_dict import convert_checkpoint

    done = convert_checkpoint(
        args.checkpoint,
        args.out,
        format=args.format,
        overwrite=args.overwrite,
        progress=StageLine("ckpt convert"),
    )
    print(
        f"converted {done.parameters / 1e6:.2f}M parameters of {done.checkpoint} to "
        f"{done.out} ({', '.join(done.files)})\n"
        f"start a run from them: t2train train ... checkpoint.init_from={done.out}"
    )
    return 0


def _cmd_import_hf(args) -> int:
    from t2train.export.hf_import import import_hf
    from t2train.residual import BASELINE

    done = import_hf(
        args.folder,
        args.out,
        seq_length=args.seq_length,
        overwrite=args.overwrite,
        progress=StageLine("import hf"),
    )
    seq = "--seq-length N" if args.seq_length is None else f"--seq-length {args.seq_length}"
    print(
        f"imported {done.parameters / 1e6:.2f}M parameters of {args.folder} as the "
        f"{BASELINE} design: checkpoint {done.checkpoint}, tokenizer "
        f"{done.out / 'tokenizer.json'}, config {done.config_file}\n"
        f"next: t2train data prepare --input 'TEXT_GLOB' --tokenizer {done.out} {seq} "
        f"--out DATA\n"
        f"      t2train train --config {done.config_file} data.path=DATA name=NAME"
    )
    return 0


def _cmd_generate(args) -> int:
    from t2train.export.generate import generate
    from t2train.export.load import load_model, open_checkpoint
    from t2train.export.tokenizer import run_tokenizer

    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise _usage(f"--top-p={args.top_p}: must be in (0, 1]")
    if args.temperature is not None and args.temperature <= 0:
        raise _usage(f"--temperature={args.temperature}: must be > 0")
    # --temperature alone samples from the whole distribution (top-p 1)
    top_p = 1.0 if args.top_p is None and args.temperature is not None else args.top_p
    checkpoint = open_checkpoint(args.checkpoint)
    tok = run_tokenizer(checkpoint, args.tokenizer)
    prompt = tok.encode_prompt(args.prompt)
    if not prompt:
        raise _usage("--prompt: encodes to no tokens; give some text")
    loaded = load_model(checkpoint, device=args.device)
    new = generate(
        loaded.model,
        prompt,
        args.max_new_tokens,
        tok.tokenizer.get_vocab_size(),
        checkpoint.config.model.seq_length,
        tok.eos_id,
        top_p,
        args.temperature or 1.0,
        args.seed,
    )
    print(args.prompt + tok.tokenizer.decode(new, skip_special_tokens=False))
    return 0


def _cmd_eval(args) -> int:
    if (args.data is None) == (args.tasks is None):
        raise _usage(
            "eval: give --data DIR (loss and perplexity on a prepared split) or "
            "--tasks NAMES (lm-eval-harness tasks), not both"
        )
    return _eval_tasks(args) if args.tasks is not None else _eval_loss(args)


def _eval_loss(args) -> int:
    from pathlib import Path

    from t2train.export.evaluate import check_same_tokenizer, evaluate
    from t2train.export.load import load_model, open_checkpoint
    from t2train.export.tokenizer import run_tokenizer_hash

    checkpoint = open_checkpoint(args.checkpoint)
    index = check_same_tokenizer(checkpoint, Path(args.data), run_tokenizer_hash(checkpoint))
    loaded = load_model(checkpoint, device=args.device)
    seq = checkpoint.config.model.seq_length
    samples = index["splits"].get(args.split, {}).get("samples", 0)
    total = min(-(-samples // args.batch_size), args.max_batches or samples)
    result = evaluate(
        loaded.model,
        Path(args.data),
        args.split,
        seq,
        args.batch_size,
        args.max_batches,
        ProgressLine(f"eval {args.split}", total),
    )
    print(
        f"{checkpoint.path} ({_label(checkpoint)}) on {args.data}/{args.split}: "
        f"loss {result.loss:.4f}, perplexity {result.perplexity:.2f} over {result.tokens:,} "
        f"tokens ({result.batches} batches of up to {args.batch_size} x {seq})"
    )
    return 0


def _eval_tasks(args) -> int:
    from pathlib import Path

    from t2train.export.load import load_model, open_checkpoint
    from t2train.export.tokenizer import run_tokenizer

    try:
        from t2train.export.harness import RunModel, run_tasks, task_manager, write_results
    except ImportError as err:
        raise _usage(
            f"--tasks needs lm-eval-harness ({err.name} is missing): pip install 't2train[eval]'"
        ) from None
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    if not tasks:
        raise _usage("--tasks: give one or more task names, comma-separated")
    manager = task_manager(tasks, args.include_path)
    checkpoint = open_checkpoint(args.checkpoint)
    tok = run_tokenizer(checkpoint, args.tokenizer)
    progress = StageLine("eval")
    progress(f"loading {checkpoint.path}")
    loaded = load_model(checkpoint, device=args.device)
    results = run_tasks(
        RunModel(loaded, tok, args.batch_size, progress),
        tasks,
        manager,
        args.num_fewshot,
        args.limit,
        progress,
    )
    from lm_eval.utils import make_table

    print(f"{checkpoint.path} ({_label(checkpoint)}):\n{make_table(results)}")
    if args.output:
        write_results(results, Path(args.output))
        print(f"scores written to {args.output}")
    return 0


class ProgressLine:
    """``what: 120/480 batches, 0:42 elapsed, eta 2:06`` on stderr every ``every`` seconds."""

    def __init__(self, what: str, total: int, every: float = 10.0):
        import time

        self.what, self.total, self.every = what, total, every
        self.started = self.last = time.monotonic()

    def __call__(self, done: int) -> None:
        import sys
        import time

        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.started
        eta = elapsed / done * max(self.total - done, 0)
        print(
            f"{self.what}: {done:,}/{self.total:,} batches, {_clock(elapsed)} elapsed, eta "
            f"{_clock(eta)}",
            file=sys.stderr,
            flush=True,
        )


class StageLine:
    """``what [0:42]: stage`` on stderr as each stage of a command starts: the conversions
    read and write whole checkpoints (minutes at billions of parameters) and cannot count
    batches."""

    def __init__(self, what: str):
        import time

        self.what, self.started = what, time.monotonic()

    def __call__(self, stage: str) -> None:
        import sys
        import time

        print(
            f"{self.what} [{_clock(time.monotonic() - self.started)}]: {stage}",
            file=sys.stderr,
            flush=True,
        )


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}"


def _usage(message: str):
    from t2train.errors import UserInputError

    return UserInputError(message)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def _size(text: str) -> int:
    """Bytes of ``123``, ``500MB``, ``5GB`` (decimal units, as Hugging Face's)."""
    match = re.fullmatch(r"(\d+)\s*(|B|KB|MB|GB|TB)", text.strip().upper())
    if match is None or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 500MB or 5GB")
    return int(match.group(1)) * _UNITS[match.group(2)]


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def _device_argument(parser) -> None:
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where the model runs (default: cuda if available)",
    )


def register_convert(ckpt_tools) -> None:
    """``t2train ckpt convert``, among the tools of ``t2train ckpt``."""
    from t2train.checkpoint.weights_file import FILES

    convert = ckpt_tools.add_parser(
        "convert",
        help="write a checkpoint's model weights as one plain state dict (torch or safetensors)",
        description="Write the model weights of CHECKPOINT (any layout, either engine) into "
        "the folder OUT as one state dict of the whole model at TP = PP = 1 under t2train's "
        "parameter names: model.pt (torch.save; torch.load(..., weights_only=True) reads "
        "it) or model.safetensors, beside the run's config (t2train.yaml), where the "
        "weights come from (t2train_weights.json) and the files' checksums. "
        "checkpoint.init_from=OUT (or the weights file) starts a run from them.",
    )
    convert.add_argument("checkpoint", help=CHECKPOINT_HELP)
    convert.add_argument("out", help="the folder to write (written as OUT.tmp, then renamed)")
    convert.add_argument(
        "--format",
        choices=list(FILES),
        default="torch",
        help="model.pt (torch.save, the default) or model.safetensors",
    )
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    convert.set_defaults(handler=_cmd_convert)


def register(commands) -> None:
    export = commands.add_parser("export", help="write a checkpoint in another format")
    formats = export.add_subparsers(dest="export_format", required=True)
    hf = formats.add_parser(
        "hf",
        help="a Hugging Face model folder (transformers, safetensors, tokenizer)",
        description="Write CHECKPOINT as a Hugging Face folder OUT: config.json, "
        "generation_config.json, model.safetensors (sharded above "
        "--max-shard-size), tokenizer.json and tokenizer_config.json. A plain "
        "pre-norm Transformer is a LlamaForCausalLM; other residual designs add "
        "modeling_t2train.py (load with trust_remote_code=True). Needs "
        "transformers (pip install 't2train[hf]').",
    )
    hf.add_argument("checkpoint", help=CHECKPOINT_HELP)
    hf.add_argument("out", help="the folder to write (written as OUT.tmp, then renamed)")
    hf.add_argument("--tokenizer", help=TOKENIZER_HELP)
    hf.add_argument(
        "--max-shard-size",
        type=_size,
        default="5GB",
        help="largest safetensors file, e.g. 2GB or 500MB (default 5GB)",
    )
    hf.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default=None,
        help="weights' dtype (default: the checkpoint's)",
    )
    hf.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    hf.set_defaults(handler=_cmd_export_hf)

    from t2train.residual import BASELINE

    imports = commands.add_parser(
        "import", help="bring a model of another format in as a checkpoint to train on from"
    )
    sources = imports.add_subparsers(dest="import_format", required=True)
    llama = sources.add_parser(
        "hf",
        help="a Hugging Face LlamaForCausalLM folder (safetensors, tokenizer.json) or Hub id",
        description=f"Write the Llama in FOLDER (config.json, model.safetensors or its shards, "
        "tokenizer.json), or of the Hugging Face Hub id FOLDER (org/name: through "
        "huggingface_hub's cache, HF_HOME or HF_HUB_CACHE, downloaded when the Hub is "
        "reachable, from the cache alone with HF_HUB_OFFLINE=1), "
        f"as a checkpoint of the {BASELINE} design in OUT, with its "
        "tokenizer and OUT/t2train.yaml (its model section and "
        "checkpoint.init_from=OUT): `t2train train --config OUT/t2train.yaml "
        "data.path=DATA` continues pretraining from it, at any layout. Prepare DATA "
        "with `t2train data prepare --tokenizer OUT`.",
    )
    llama.add_argument(
        "folder", help="the Hugging Face model folder, or a Hub id such as meta-llama/Llama-3.2-1B"
    )
    llama.add_argument("out", help="the folder to write")
    llama.add_argument(
        "--seq-length",
        type=_positive,
        default=None,
        help="model.seq_length to train at (default: the model's max_position_embeddings)",
    )
    llama.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    llama.set_defaults(handler=_cmd_import_hf)

    gen = commands.add_parser(
        "generate",
        help="continue a prompt with a checkpoint (greedy or sampled)",
        description="Continue --prompt with CHECKPOINT's model and its run's tokenizer: "
        "greedy by default, nucleus sampling with --top-p, sampling from the whole "
        "distribution with --temperature alone. The context is the newest "
        "model.seq_length tokens (a sliding window, positions from 0): past that "
        "length transformers' generate on the exported model, which keeps the whole "
        "context at positions the model never trained on, gives other tokens.",
    )
    gen.add_argument("checkpoint", help=CHECKPOINT_HELP)
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=_positive, default=64)
    gen.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample from the smallest set of tokens with this probability mass (default: greedy)",
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="divide the logits by this before sampling (default 1 with --top-p); "
        "without --top-p, samples from the whole distribution",
    )
    gen.add_argument("--seed", type=int, default=0, help="of the sampling")
    gen.add_argument("--tokenizer", help=TOKENIZER_HELP)
    _device_argument(gen)
    gen.set_defaults(handler=_cmd_generate)

    ev = commands.add_parser(
        "eval",
        help="a checkpoint's loss on a prepared split, or its lm-eval-harness scores",
        description="--data: mean next-token loss, perplexity and tokens evaluated over a "
        "split of a dataset prepared with the run's tokenizer (refused otherwise, "
        "naming both tokenizer hashes), at the run's sequence length. --tasks: "
        "lm-eval-harness tasks (pip install 't2train[eval]'), answered by the "
        "trained model itself for any residual design; contexts longer than "
        "model.seq_length keep their newest tokens.",
    )
    ev.add_argument("checkpoint", help=CHECKPOINT_HELP)
    ev.add_argument("--data", help="a prepared dataset directory")
    ev.add_argument("--split", default="val", help="the split to read (default val)")
    ev.add_argument(
        "--max-batches",
        type=_positive,
        default=None,
        help="stop after this many batches (default: the whole split)",
    )
    ev.add_argument("--tasks", help="lm-eval task or group names, comma-separated")
    ev.add_argument(
        "--include-path", help="a folder (or YAML file) of your own lm-eval task definitions"
    )
    ev.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="examples put before each question (default: the task's)",
    )
    ev.add_argument(
        "--limit",
        type=float,
        default=None,
        help="documents per task (a number), or a fraction of each below 1",
    )
    ev.add_argument("--output", help="write the scores to this JSON file")
    ev.add_argument("--tokenizer", help=TOKENIZER_HELP)
    ev.add_argument("--batch-size", type=_positive, default=8)
    _device_argument(ev)
    ev.set_defaults(handler=_cmd_eval)
