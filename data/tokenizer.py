"""The tokenizer of a prepared dataset: trained here (byte-level BPE) or brought by the user.

Either way it is saved as ``tokenizer.json`` next to the shards and identified by its sha256,
so a model is never trained or evaluated with token ids from a different vocabulary. A
brought tokenizer is a ``tokenizer.json`` or a Hugging Face tokenizer folder; a folder with
only a SentencePiece ``tokenizer.model`` (Llama 2, Mistral, Gemma) is converted once, by
transformers, to the same fast tokenizer that ``AutoTokenizer`` gives (Llama's when the folder
has no config naming the class).

Documents are joined with the end-of-document token (EOS); a tokenizer that starts every
text with a begin token (its post-processor adds one: Llama, Mistral, Gemma) gets it at the
start of each document too (``bos_id``), as its models were trained.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from t2train.data.errors import DataError

EOS = "<|endoftext|>"  # separates documents in the token stream
# A brought tokenizer's end-of-document token: the first of these it defines (GPT-2 and
# t2train's own BPE, Llama 3, Llama 2 / Mistral, Gemma).
EOS_TOKENS = (EOS, "<|end_of_text|>", "</s>", "<eos>")
# Its begin-of-document token, for ``bos="always"``: the first of these it defines.
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
BOS_CHOICES = ("auto", "always", "never")
TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"
MIN_VOCAB = 257  # the 256 byte tokens plus EOS


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style: any input is encodable, no unknown token) on ``texts``.

    A small corpus may end with fewer merges than asked: the real size is
    ``tokenizer.get_vocab_size()``.
    """
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"vocab_size={vocab_size}: must be >= {MIN_VOCAB} "
            "(256 byte tokens plus the end-of-text token)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The BPE merges run in Rust, where Python's signal handlers wait: a Ctrl-C would land only
    # when training ends. Training in a thread leaves the main thread free to take it.
    failed: list[BaseException] = []

    def learn() -> None:
        try:
            tokenizer.train_from_iterator(texts, trainer)
        except BaseException as err:  # raised again in the caller
            failed.append(err)

    learning = threading.Thread(target=learn, name="t2train-bpe", daemon=True)
    learning.start()
    while learning.is_alive():
        learning.join(0.2)
    if failed:
        raise failed[0]
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A user's ``tokenizer.json``, or a Hugging Face tokenizer folder's (a SentencePiece
    ``tokenizer.model`` converted); it must define an end-of-document token (``EOS_TOKENS``)."""
    path = Path(path)
    if path.is_dir():
        if not (path / TOKENIZER_FILE).is_file() and (path / SENTENCEPIECE_FILE).is_file():
            tokenizer = _converted(path)
            eos_id(tokenizer, path)
            return tokenizer
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(
            f"tokenizer {path}: no such file (expected a Hugging Face tokenizer.json, "
            f"or a folder with one or with a SentencePiece {SENTENCEPIECE_FILE})"
        )
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"tokenizer {path}: not a valid tokenizer.json ({err})") from None
    eos_id(tokenizer, path)
    return tokenizer


def _converted(folder: Path) -> Tokenizer:
    """The fast tokenizer transformers makes of a folder's SentencePiece model (offline): of
    the class its ``tokenizer_config.json`` or ``config.json`` names, else Llama's."""
    try:
        from transformers import AutoTokenizer, LlamaTokenizerFast  # noqa: PLC0415 - transformers (the hf extra): a SentencePiece folder only
    except ImportError:
        raise DataError(
            f"tokenizer {folder}: only a SentencePiece {SENTENCEPIECE_FILE}; "
            "converting it needs transformers: pip install 't2train[hf]'"
        ) from None
    try:
        if _names_tokenizer_class(folder):
            converted = AutoTokenizer.from_pretrained(
                str(folder), use_fast=True, local_files_only=True
            )
        else:
            # A bare tokenizer.model is how Llama 2 and Mistral ship outside transformers:
            # converted as their hub tokenizer.json has it (a space before the text, <s>
            # first, byte fallback), which encodes as SentencePiece itself does.
            converted = LlamaTokenizerFast(
                vocab_file=str(folder / SENTENCEPIECE_FILE), legacy=True, add_prefix_space=True
            )
    except Exception as err:  # transformers raises many types for a folder it cannot read
        cause = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise DataError(
            f"tokenizer {folder}: transformers cannot load its {SENTENCEPIECE_FILE} "
            f"({type(err).__name__}: {cause if len(cause) <= 300 else cause[:297] + '...'})"
        ) from None
    if not converted.is_fast:
        raise DataError(
            f"tokenizer {folder}: transformers could not convert its "
            f"{SENTENCEPIECE_FILE} to a fast tokenizer (it needs sentencepiece "
            "and protobuf: pip install 't2train[hf]')"
        )
    return converted.backend_tokenizer


def _names_tokenizer_class(folder: Path) -> bool:
    """Whether transformers' AutoTokenizer can tell the folder's tokenizer class: from
    ``tokenizer_config.json`` (``tokenizer_class``) or ``config.json`` (``model_type``)."""
    for name, key in (("tokenizer_config.json", "tokenizer_class"), ("config.json", "model_type")):
        try:
            if json.loads((folder / name).read_text()).get(key):
                return True
        except (OSError, ValueError, AttributeError):  # absent, unreadable or not an object
            continue
    return False


def default_bos_id(tokenizer: Tokenizer) -> Optional[int]:
    """The begin token the tokenizer puts before every text by default (its post-processor),
    or None: what encoding a text with and without its special tokens adds in front."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    special = tokenizer.encode("a", add_special_tokens=True).ids
    front = next(
        (k for k in range(len(special) - len(plain) + 1) if special[k : k + len(plain)] == plain), 0
    )
    return special[0] if front else None


def document_bos(
    tokenizer: Tokenizer, choice: str, source: str | Path = "tokenizer"
) -> Optional[int]:
    """The token each document starts with: ``auto``, the tokenizer's default begin token
    (``default_bos_id``, or none); ``always``, its begin token even if it adds none by
    default; ``never``, none."""
    if choice not in BOS_CHOICES:
        raise DataError(f"bos={choice!r}: choose one of {', '.join(BOS_CHOICES)}")
    default = None if choice == "never" else default_bos_id(tokenizer)
    if choice != "always" or default is not None:
        return default
    for token in BOS_TOKENS:
        if tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    raise DataError(
        f"bos=always: {source} has none of the begin tokens {', '.join(map(repr, BOS_TOKENS))}"
    )


def eos_token(tokenizer: Tokenizer, source: str | Path = "tokenizer") -> str:
    """The end-of-text token that joins documents: the first of ``EOS_TOKENS`` it defines."""
    for token in EOS_TOKENS:
        if tokenizer.token_to_id(token) is not None:
            return token
    raise DataError(
        f"{source}: has none of the tokens {', '.join(map(repr, EOS_TOKENS))}; "
        "expected one as the end-of-document (EOS) token that separates documents"
    )


def eos_id(tokenizer: Tokenizer, source: str | Path = "tokenizer") -> int:
    """The id of the end-of-text token that joins documents."""
    return tokenizer.token_to_id(eos_token(tokenizer, source))


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> str:
    """Write ``out_dir/tokenizer.json``; returns its sha256."""
    path = Path(out_dir) / TOKENIZER_FILE
    tokenizer.save(str(path))
    return file_sha256(path)


def token_dtype(vocab_size: int) -> str:
    """The narrowest unsigned column type that holds every id below ``vocab_size``.

    Shards store ids as uint16 or uint32; a vocabulary whose ids do not fit uint32 cannot be
    stored without wrapping ids around, so it is refused.
    """
    for dtype in ("uint16", "uint32"):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return dtype
    raise DataError(
        f"tokenizer vocabulary of {vocab_size} tokens: too large, ids above "
        f"{np.iinfo(np.uint32).max} do not fit the uint32 token column"
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
