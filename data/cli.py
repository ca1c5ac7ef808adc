"""``t2train data prepare|fetch``: the command-line face of the data layer."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from t2train.data.errors import DataError

PREPARE_EPILOG = """\
examples:
  t2train data prepare --corpus shakespeare --out data/shakespeare --seq-length 256
  t2train data prepare --input 'corpus/*.jsonl' --text-field content --out data/web \\
      --tokenizer my/tokenizer.json --workers 8
  t2train data prepare --input 'crawl/*.parquet' --out data/crawl --vocab-size 32000
  t2train data prepare --input books/ --pattern '*.txt' --encoding cp1252 --out data/books
  t2train data prepare --corpus shakespeare --val-files 'hamlet_*' --out data/heldout
writes OUT/train/ and OUT/val/ (MDS shards), OUT/tokenizer.json and OUT/index.json;
train with: t2train train ... data.path=OUT
"""


def default_cache_dir() -> Path:
    return Path(os.environ.get("T2TRAIN_CACHE") or Path.home() / ".cache" / "t2train")


def default_workers() -> int:
    return len(os.sched_getaffinity(0))


def register(subparsers) -> None:
    """Add the ``data`` command (with ``prepare`` and ``fetch``) to a subparsers object."""
    from t2train.data.corpora import CORPORA
    from t2train.data.inputs import PATTERNS

    data = subparsers.add_parser(
        "data",
        help="prepare datasets (tokenize text into MDS shards)",
        description="Prepare text for training, or fetch a named public corpus.",
    )
    commands = data.add_subparsers(dest="data_command", required=True)

    prepare = commands.add_parser(
        "prepare",
        help="tokenize text files into a dataset directory",
        description="Tokenize text into fixed-length samples of seq_length+1 tokens, split "
        "into train/val, and write mosaicml-streaming MDS shards.",
        epilog=PREPARE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = prepare.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        action="append",
        metavar="PATH_OR_GLOB",
        help="a .txt file (one document), .jsonl file (one document per "
        "line) or .parquet file (one document per row), a glob of them, "
        "or a directory (its files matching --pattern, in all "
        "subdirectories); repeat for more (quote globs)",
    )
    source.add_argument(
        "--corpus",
        choices=sorted(CORPORA),
        help="a named public corpus, downloaded once into --cache-dir",
    )
    prepare.add_argument(
        "--pattern",
        action="append",
        metavar="GLOB",
        help="with a directory --input: the file names to take, e.g. "
        "'*.jsonl' (repeat for more); default: " + ", ".join(PATTERNS),
    )
    prepare.add_argument(
        "--encoding",
        default="utf-8",
        help="the encoding of text inputs (.txt, .jsonl, binary Parquet "
        "columns), a Python codec name such as latin-1, cp1252 or utf-16; "
        "default %(default)s",
    )
    prepare.add_argument(
        "--skip-binary",
        action="store_true",
        help="leave out input files that do not look like text (NUL "
        "characters or many invalid sequences in their first 64 KiB) "
        "instead of stopping; they are listed in the summary and index",
    )
    prepare.add_argument("--out", required=True, help="the dataset directory to create")
    prepare.add_argument(
        "--seq-length",
        type=int,
        default=256,
        help="tokens per training sequence (samples hold one more, for the "
        "labels); default %(default)s",
    )
    prepare.add_argument(
        "--vocab-size",
        type=int,
        default=8192,
        help="size of the byte-level BPE trained on the input; default "
        "%(default)s (ignored with --tokenizer)",
    )
    prepare.add_argument(
        "--tokenizer",
        metavar="TOKENIZER",
        help="use this Hugging Face tokenizer.json, or tokenizer folder (one "
        "with only a SentencePiece tokenizer.model is converted), instead "
        "of training one; it must define an end-of-document token "
        "(<|endoftext|>, <|end_of_text|>, </s> or <eos>)",
    )
    prepare.add_argument(
        "--bos",
        default="auto",
        help="start each document with the begin token: auto (default) where "
        "the tokenizer puts one before every text (Llama's <s>), always, "
        "or never",
    )
    prepare.add_argument(
        "--text-field",
        default="text",
        help="the JSON field (.jsonl) or column (.parquet) holding each "
        "document's text; default %(default)s",
    )
    split = prepare.add_mutually_exclusive_group()
    split.add_argument(
        "--val-fraction",
        type=float,
        help="share of samples held out for validation, drawn at random from "
        "the same files as training; the default (0.05) unless --val-files",
    )
    split.add_argument(
        "--val-files",
        action="append",
        metavar="GLOB",
        help="hold out whole input files for validation instead: those whose "
        "name (or path) matches GLOB, e.g. 'hamlet_*' (repeat for more; "
        "quote globs); the tokenizer then learns from the other files only. "
        "Keep versions of one text together, so none of it is trained on",
    )
    prepare.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random train/val assignment of samples; default %(default)s",
    )
    prepare.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="processes that tokenize in parallel (1: in this process); the "
        "output is the same for any number; default: the usable CPUs, "
        "%(default)s here",
    )
    prepare.add_argument(
        "--compression",
        default="zstd",
        help="shard compression (a mosaicml-streaming codec, e.g. zstd, "
        "zstd:9, gz, br, snappy) or 'none'; default %(default)s",
    )
    prepare.add_argument(
        "--progress-every",
        type=float,
        default=30,
        metavar="SECONDS",
        help="when stderr is not a terminal (a batch log), print a progress "
        "line on stdout every SECONDS instead of progress bars (0: "
        "none); default %(default)s",
    )
    prepare.add_argument(
        "--overwrite", action="store_true", help="replace a dataset already in --out"
    )
    _add_cache_dir(prepare)
    prepare.set_defaults(handler=main_data)

    fetch = commands.add_parser(
        "fetch",
        help="download a named corpus into the cache",
        description="Download a named public corpus into the cache "
        "(once) and print its files, one per line.",
    )
    fetch.add_argument("corpus", choices=sorted(CORPORA), help="the corpus to fetch")
    _add_cache_dir(fetch)
    fetch.set_defaults(handler=main_data)


def _add_cache_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="where downloaded corpora are kept; default $T2TRAIN_CACHE or "
        "~/.cache/t2train (now %(default)s)",
    )


def main_data(args: argparse.Namespace) -> int:
    """Run ``data prepare`` or ``data fetch``; a bad input prints ``error: ...`` and returns 2."""
    try:
        return _prepare(args) if args.data_command == "prepare" else _fetch(args)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _fetch(args) -> int:
    from t2train.data.corpora import fetch_corpus

    files = fetch_corpus(args.corpus, args.cache_dir)
    print("\n".join(map(str, files)))
    print(f"{args.corpus}: {len(files)} files in {files[0].parent}", file=sys.stderr)
    return 0


def _prepare(args) -> int:
    from t2train.data.corpora import fetch_corpus
    from t2train.data.inputs import PATTERNS, encoding_name
    from t2train.data.prepare import DEFAULT_VAL_FRACTION, prepare_dataset

    inputs = args.input or [str(p) for p in fetch_corpus(args.corpus, args.cache_dir)]
    if args.progress_every < 0:
        raise DataError(f"--progress-every {args.progress_every}: must be >= 0 seconds")
    bars = sys.stderr.isatty()
    start = time.monotonic()
    index = prepare_dataset(
        inputs,
        args.out,
        args.seq_length,
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        val_files=args.val_files or (),
        val_fraction=(DEFAULT_VAL_FRACTION if args.val_fraction is None else args.val_fraction),
        seed=args.seed,
        text_field=args.text_field,
        overwrite=args.overwrite,
        workers=args.workers,
        compression=None if args.compression == "none" else args.compression,
        progress=bars,
        progress_every=0 if bars else args.progress_every,
        encoding=args.encoding,
        skip_binary=args.skip_binary,
        patterns=args.pattern or PATTERNS,
        bos=args.bos,
    )
    elapsed = time.monotonic() - start
    total = index["total_tokens"]
    tok = index["tokenizer"]
    print(
        f"prepared {args.out}: {total:,} tokens from {_count(len(index['sources']), 'file')} "
        f"in {elapsed:.1f}s ({total / elapsed:,.0f} tokens/s, "
        f"{_count(args.workers, 'worker')})"
    )
    held_out = index["val_split"].get("files", [])
    for split, facts in index["splits"].items():
        source = (
            f" from {_count(len(held_out), 'held-out file')}" if held_out and split == "val" else ""
        )
        print(
            f"  {split:<5} {facts['samples']:>9,} samples of {index['seq_length'] + 1} tokens "
            f"in {_count(facts['shards'], 'shard')}{source}"
        )
    print(
        f"  tokenizer: {tok['source']}, vocab {index['vocab_size']}, eos id "
        f"{index['eos_id']}, sha256 {tok['sha256'][:12]}"
    )
    replaced = sum(s["replaced_chars"] for s in index["sources"])
    empty_docs = sum(s["empty_documents"] for s in index["sources"])
    notes = [
        _skipped(index["skipped_empty_files"], "empty"),
        _skipped(index["skipped_binary_files"], "binary"),
    ]
    notes += [f"skipped {_count(empty_docs, 'empty document')}"] if empty_docs else []
    invalid = f"invalid {encoding_name(args.encoding)} sequence"
    notes += [f"replaced {_count(replaced, invalid)} with U+FFFD"] if replaced else []
    notes += [f"dropped the last {index['dropped_tokens']} tokens (less than one sample)"]
    print("\n".join(f"  {note}" for note in notes if note))
    print(
        f"next: t2train train --preset tiny data.path={args.out} model.seq_length="
        f"{args.seq_length}   (any preset; model.seq_length at most {args.seq_length})"
    )
    return 0


def _count(number: int, thing: str) -> str:
    return f"{number:,} {thing}{'' if number == 1 else 's'}"


def _skipped(paths: list[str], kind: str, named: int = 3) -> str:
    """``skipped 2 empty files: a.txt, b.txt``, naming the first ``named``."""
    if not paths:
        return ""
    more = f" and {len(paths) - named} more" if len(paths) > named else ""
    return (
        f"skipped {_count(len(paths), kind + ' file')}: "
        f"{', '.join(_shown(p) for p in paths[:named])}{more}"
    )


def _shown(path: str) -> str:
    """A path relative to the working directory when it is below it."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path
