"""prepare_dataset / read_index: what is written, that it is exactly the tokenized input, and
that bad input fails with a message naming the cause, before any output exists."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from t2train.data.index import read_index
from t2train.data.loader import StreamingWorld, TokenBatches
from t2train.data.prepare import DataError, prepare_dataset
from t2train.data.tokenizer import EOS, file_sha256, token_dtype

from textgen import english_ish

ONE = StreamingWorld(0, 1, 0, 1)


def all_samples(path, split, seq_length):
    """Every sample of a split, in stored order, as rows of seq_length+1 ids."""
    batches = TokenBatches(path, split, 1, seq_length, ONE, seed=0, shuffle=False, finite=True)
    return [np.append(b["tokens"][0].numpy(), b["labels"][0, -1].item()) for b in batches]


def test_index_describes_shards_of_the_tokenized_input(text_files, tmp_path):
    out = tmp_path / "ds"
    index = prepare_dataset(
        [str(p) for p in text_files], out, seq_length=31, vocab_size=300, val_fraction=0.2, seed=3
    )

    assert read_index(out) == index == json.loads((out / "index.json").read_text())
    assert {p.name for p in out.iterdir()} == {"index.json", "tokenizer.json", "train", "val"}
    assert index["seq_length"] == 31 and index["token_dtype"] == "uint16"
    assert index["tokenizer"]["sha256"] == file_sha256(out / "tokenizer.json")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert index["vocab_size"] == tok.get_vocab_size() <= 300
    assert index["eos_id"] == tok.token_to_id(EOS)

    # Token counts add up: per file, per split, and what did not fill a last sample.
    assert [s["path"] for s in index["sources"]] == [str(p.resolve()) for p in text_files]
    assert sum(s["tokens"] for s in index["sources"]) == index["total_tokens"]
    train, val = index["splits"]["train"], index["splits"]["val"]
    assert train["tokens"] == 32 * train["samples"] and val["tokens"] == 32 * val["samples"]
    assert train["tokens"] + val["tokens"] + index["dropped_tokens"] == index["total_tokens"]
    assert 0 <= index["dropped_tokens"] < 32
    assert val["samples"] > 0 and train["shards"] >= 1 and val["shards"] >= 1
    assert 0.1 < val["samples"] / (train["samples"] + val["samples"]) < 0.3

    # The samples are exactly the documents' tokens joined by EOS, cut every 32 tokens.
    stream = np.concatenate(
        [np.append(tok.encode(p.read_text()).ids, index["eos_id"]) for p in text_files]
    )
    expected = {tuple(stream[i : i + 32]) for i in range(0, len(stream) - 31, 32)}
    got = [tuple(s) for split in ("train", "val") for s in all_samples(out, split, 31)]
    assert len(got) == len(expected) and set(got) == expected


def test_held_out_files_are_the_val_split_and_unseen_by_the_tokenizer(text_files, tmp_path):
    index = prepare_dataset(
        text_files, tmp_path / "ds", seq_length=15, vocab_size=300, val_files=["doc1.*"], workers=2
    )
    held, kept = text_files[1], [text_files[0], text_files[2]]
    assert index["val_split"]["by"] == "file" and index["val_fraction"] is None
    assert index["val_split"]["files"] == [str(held.resolve())]
    assert index["tokenizer"]["trained_on"] == "training files"
    # The BPE is the one the training files alone give.
    alone = prepare_dataset(kept, tmp_path / "alone", seq_length=15, vocab_size=300)
    assert index["tokenizer"]["sha256"] == alone["tokenizer"]["sha256"]
    assert alone["val_split"]["by"] == "sample" and alone["tokenizer"]["trained_on"] == "all inputs"

    # Each split is exactly its own files' tokens, cut into samples on its own.
    tok = Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json"))

    def cut(files):
        stream = np.concatenate(
            [np.append(tok.encode(p.read_text()).ids, index["eos_id"]) for p in files]
        )
        return [tuple(stream[i : i + 16]) for i in range(0, len(stream) - 15, 16)]

    for split, files in (("train", kept), ("val", [held])):
        assert [tuple(s) for s in all_samples(tmp_path / "ds", split, 15)] == cut(files)
        assert index["splits"][split]["samples"] == len(cut(files))
    assert sum(s["tokens"] for s in index["sources"]) == index["total_tokens"]


def test_held_out_patterns_must_match_some_but_not_all_inputs(text_files, tmp_path):
    with pytest.raises(DataError, match=r"val_files 'hamlet\*': matches none of the 3 input"):
        prepare_dataset(text_files, tmp_path / "ds", seq_length=16, val_files=["hamlet*"])
    with pytest.raises(
        DataError,
        match=r"val_files 'doc0.txt', '\*/corpus/doc\[12\].txt': "
        r"match all 3 input file\(s\)",
    ):
        prepare_dataset(
            text_files,
            tmp_path / "ds",
            seq_length=16,
            val_files=["doc0.txt", "*/corpus/doc[12].txt"],
        )
    short = text_files[0].with_name("short.txt")
    short.write_text("Too short to hold out.")
    with pytest.raises(
        DataError,
        match=r"the val files give \d+ tokens, fewer than one sample "
        r"of seq_length\+1=17",
    ):
        prepare_dataset(
            [*text_files, short], tmp_path / "ds", seq_length=16, val_files=["short.txt"]
        )
    assert not (tmp_path / "ds").exists()


def test_same_inputs_and_seed_give_the_same_dataset(text_files, tmp_path):
    a = prepare_dataset(text_files, tmp_path / "a", seq_length=16, vocab_size=300)
    b = prepare_dataset(text_files, tmp_path / "b", seq_length=16, vocab_size=300)
    assert a == b
    for split in ("train", "val"):
        x, y = all_samples(tmp_path / "a", split, 16), all_samples(tmp_path / "b", split, 16)
        assert len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y, strict=True))


def test_jsonl_with_a_given_tokenizer_and_text_field(text_files, tmp_path):
    first = prepare_dataset(text_files, tmp_path / "first", seq_length=16, vocab_size=300)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"id": i, "body": english_ish(i, 5)}) + "\n" for i in range(30)) + "\n"
    )  # a trailing blank line is ignored
    index = prepare_dataset(
        [str(jsonl)],
        tmp_path / "ds",
        seq_length=16,
        text_field="body",
        tokenizer=tmp_path / "first" / "tokenizer.json",
    )
    assert index["tokenizer"]["sha256"] == first["tokenizer"]["sha256"]
    assert index["sources"][0]["documents"] == 30
    tok = Tokenizer.from_file(str(tmp_path / "first" / "tokenizer.json"))
    assert index["total_tokens"] == sum(
        len(tok.encode(english_ish(i, 5)).ids) + 1 for i in range(30)
    )


def test_globs_empty_files_and_invalid_utf8(text_files, tmp_path):
    folder = text_files[0].parent
    (folder / "empty.txt").write_text("")
    (folder / "blank.txt").write_text("\n  \n")
    # a few bad bytes (one in 40 characters) are replaced and counted, not refused
    (folder / "bad.txt").write_bytes(b"caf\xe9 \xff\xfe and a few more words here\n" * 50)
    with pytest.warns(
        UserWarning,
        match=r"bad.txt: 150 invalid UTF-8 sequence\(s\) replaced "
        r"with U\+FFFD \(text in another encoding\? give it "
        r"with --encoding\)",
    ):
        index = prepare_dataset(
            [str(folder / "*.txt")], tmp_path / "ds", seq_length=16, vocab_size=300
        )
    assert sorted(p.rsplit("/", 1)[1] for p in index["skipped_empty_files"]) == [
        "blank.txt",
        "empty.txt",
    ]
    assert len(index["sources"]) == 4
    assert [s["replaced_chars"] for s in index["sources"] if s["path"].endswith("bad.txt")] == [150]


def test_binary_inputs_are_refused_naming_the_file_or_skipped(text_files, tmp_path):
    folder = text_files[0].parent
    (folder / "ls.txt").write_bytes(bytes(range(256)) * 400)  # 100 KiB with NUL bytes
    noise = bytes(b for b in np.random.default_rng(0).integers(1, 256, 20_000, dtype=np.uint8))
    (folder / "noise.txt").write_bytes(noise)  # no NUL, but mostly invalid UTF-8
    with pytest.raises(
        DataError,
        match=rf"^input {folder}/ls.txt: does not look like UTF-8 "
        r"text \(NUL characters in its first 64 KiB\) \(and 1 "
        r"more such file\(s\)\); skip such files with "
        r"--skip-binary, or give the encoding with --encoding",
    ):
        prepare_dataset([folder], tmp_path / "ds", seq_length=16, vocab_size=300)
    with pytest.raises(
        DataError,
        match=rf"^input {folder}/noise.txt: does not look like UTF-8 "
        r"text \(\d+ invalid UTF-8 sequences in the file \(\d+% ",
    ):
        prepare_dataset([folder / "noise.txt"], tmp_path / "ds", seq_length=16)
    assert not (tmp_path / "ds").exists()

    index = prepare_dataset(
        [folder], tmp_path / "ds", seq_length=16, vocab_size=300, skip_binary=True
    )
    assert index["skipped_binary_files"] == [str(folder / "ls.txt"), str(folder / "noise.txt")]
    assert sorted(Path(s["path"]).name for s in index["sources"]) == [
        "doc0.txt",
        "doc1.txt",
        "doc2.txt",
    ]
    with pytest.raises(DataError, match=r"no text inputs: all 1 input file\(s\) look binary"):
        prepare_dataset([folder / "ls.txt"], tmp_path / "ds2", seq_length=16, skip_binary=True)


def test_other_encodings(tmp_path):
    text = "Le café crème était très sucré, à côté du gâteau. " * 400  # 19% accented
    (tmp_path / "latin1.txt").write_bytes(text.encode("latin-1"))
    with pytest.raises(
        DataError,
        match=r"latin1.txt: does not look like UTF-8 text \(\d+ "
        r"invalid UTF-8 sequences in the file",
    ):
        prepare_dataset([tmp_path / "latin1.txt"], tmp_path / "ds", seq_length=16)
    index = prepare_dataset(
        [tmp_path / "latin1.txt"],
        tmp_path / "ds",
        seq_length=16,
        vocab_size=300,
        encoding="latin-1",
    )
    assert index["encoding"] == "latin-1" and index["sources"][0]["replaced_chars"] == 0
    tok = Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json"))
    ids = np.concatenate(all_samples(tmp_path / "ds", "train", 16)).tolist()
    assert "Le café crème était très sucré" in tok.decode(ids)

    # UTF-16 text has NUL bytes, yet it is text in its encoding; JSONL lines cannot be split
    (tmp_path / "wide.txt").write_text(text, encoding="utf-16")
    with pytest.raises(DataError, match=r"wide.txt: does not look like UTF-8 text \(NUL"):
        prepare_dataset([tmp_path / "wide.txt"], tmp_path / "ds16", seq_length=16)
    index = prepare_dataset(
        [tmp_path / "wide.txt"], tmp_path / "ds16", seq_length=16, vocab_size=300, encoding="utf-16"
    )
    assert index["total_tokens"] > 0 and index["sources"][0]["replaced_chars"] == 0
    (tmp_path / "wide.jsonl").write_text('{"text": "x"}\n', encoding="utf-16")
    with pytest.raises(
        DataError,
        match=r"wide.jsonl: JSONL needs an encoding that writes a "
        r"newline as one byte, not 'utf-16'",
    ):
        prepare_dataset(
            [tmp_path / "wide.jsonl"], tmp_path / "dsj", seq_length=16, encoding="utf-16"
        )
    with pytest.raises(DataError, match=r"encoding='klingon': unknown \(expected a Python codec"):
        prepare_dataset(
            [tmp_path / "latin1.txt"], tmp_path / "dsk", seq_length=16, encoding="klingon"
        )


def test_directories_are_searched_recursively_by_pattern(text_files, tmp_path):
    folder = text_files[0].parent
    (folder / "sub" / "deeper").mkdir(parents=True)
    (folder / "sub" / "deeper" / "late.txt").write_text(english_ish(9, 5))
    (folder / "sub" / "rows.jsonl").write_text('{"text": "one two"}\n')
    (folder / "README.md").write_text("not an input\n")
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "old.txt").write_text("hidden\n")
    index = prepare_dataset([folder], tmp_path / "ds", seq_length=16, vocab_size=300)
    assert [Path(s["path"]).relative_to(folder).as_posix() for s in index["sources"]] == [
        "doc0.txt",
        "doc1.txt",
        "doc2.txt",
        "sub/deeper/late.txt",
        "sub/rows.jsonl",
    ]
    index = prepare_dataset(
        [folder], tmp_path / "ds2", seq_length=16, vocab_size=300, patterns=["*.jsonl", "late.*"]
    )
    assert [Path(s["path"]).name for s in index["sources"]] == ["late.txt", "rows.jsonl"]
    with pytest.raises(
        DataError,
        match=rf"input {folder}: a directory without files matching "
        r"'\*.csv' \(in any subdirectory\); choose them with "
        r"--pattern",
    ):
        prepare_dataset([folder], tmp_path / "ds3", seq_length=16, patterns=["*.csv"])


@pytest.mark.parametrize(
    "inputs, cause",
    [
        (["no/such/file.txt"], "input no/such/file.txt: no such file"),
        (["no/such/*.txt"], "input 'no/such/*.txt': the glob matches no files"),
        ([], "no inputs"),
    ],
)
def test_missing_inputs_fail_before_any_output(tmp_path, inputs, cause):
    with pytest.raises(DataError, match=cause.replace("*", r"\*").replace(".", r"\.")):
        prepare_dataset(inputs, tmp_path / "out" / "ds", seq_length=16)
    assert not (tmp_path / "out").exists()


def test_unsupported_suffix_and_bad_settings(text_files, tmp_path):
    other = tmp_path / "notes.md"
    other.write_text("# hi\n")
    with pytest.raises(
        DataError,
        match=r"notes.md: unsupported type '.md', expected "
        r"\.txt, \.jsonl or \.parquet",
    ):
        prepare_dataset([other], tmp_path / "ds", seq_length=16)
    with pytest.raises(DataError, match=r"val_fraction=0: must be > 0 and < 1"):
        prepare_dataset(text_files, tmp_path / "ds", seq_length=16, val_fraction=0)
    with pytest.raises(DataError, match=r"vocab_size=100: must be >= 257"):
        prepare_dataset(text_files, tmp_path / "ds", seq_length=16, vocab_size=100)
    with pytest.raises(DataError, match=r"compression='lzma': expected one of"):
        prepare_dataset(text_files, tmp_path / "ds", seq_length=16, compression="lzma")
    assert not (tmp_path / "ds").exists()


def test_missing_json_field_names_file_and_line(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "one two three"}\n{"body": "four"}\n')
    with pytest.raises(
        DataError,
        match=r"docs.jsonl:2: no field 'text' \(fields: 'body'\); "
        r"choose the text field with --text-field",
    ):
        prepare_dataset([jsonl], tmp_path / "out" / "ds", seq_length=4)
    jsonl.write_text('{"text": "one"}\nnot json\n')
    with pytest.raises(DataError, match=r"docs.jsonl:2: not valid JSON"):
        prepare_dataset([jsonl], tmp_path / "out" / "ds", seq_length=4)
    assert not (tmp_path / "out").exists()


def test_error_while_writing_leaves_no_dataset(tmp_path):
    """A JSON error found after shards were started: nothing is left beside the output."""
    tok_dir = tmp_path / "tok"
    prepare_dataset(
        [_write(tmp_path / "a.txt", english_ish(0, 30))], tok_dir, seq_length=8, vocab_size=300
    )
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"text": english_ish(1, 30)}) + "\n" + '{"body": "x"}\n')
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match=r"docs.jsonl:2: no field 'text'"):
        prepare_dataset([jsonl], out / "ds", seq_length=8, tokenizer=tok_dir / "tokenizer.json")
    assert list(out.iterdir()) == []


def test_non_empty_out_dir_and_overwrite(text_files, tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match=rf"output directory {out} is not empty; .*--overwrite"):
        prepare_dataset(text_files, out, seq_length=16, vocab_size=300)
    with pytest.raises(DataError, match=r"holds no prepared dataset \(index.json\); refusing"):
        prepare_dataset(text_files, out, seq_length=16, vocab_size=300, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"

    (out / "keep.txt").unlink()
    prepare_dataset(text_files, out, seq_length=16, vocab_size=300)
    index = prepare_dataset(text_files, out, seq_length=8, vocab_size=300, overwrite=True)
    assert read_index(out)["seq_length"] == 8 == index["seq_length"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "ds"]  # no temp dirs left


def test_too_little_text_for_two_samples(tmp_path):
    with pytest.raises(DataError, match=r"fewer than 2 samples of seq_length\+1=1025"):
        prepare_dataset(
            [_write(tmp_path / "a.txt", "just a few words\n")],
            tmp_path / "ds",
            seq_length=1024,
            vocab_size=300,
        )
    assert not (tmp_path / "ds").exists()


def test_two_samples_fill_both_splits(tmp_path):
    text = english_ish(0, 3)
    tok_dir = tmp_path / "tok"
    prepare_dataset(
        [_write(tmp_path / "big.txt", english_ish(1, 20))], tok_dir, seq_length=4, vocab_size=300
    )
    n = len(Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(text).ids) + 1
    index = prepare_dataset(
        [_write(tmp_path / "a.txt", text)],
        tmp_path / "ds",
        seq_length=n // 2 - 1,
        tokenizer=tok_dir / "tokenizer.json",
        val_fraction=0.01,
    )
    assert index["splits"]["train"]["samples"] == index["splits"]["val"]["samples"] == 1


def test_user_tokenizer_without_eos(text_files, tmp_path):
    prepare_dataset(text_files, tmp_path / "ds", seq_length=16, vocab_size=300)
    spec = json.loads((tmp_path / "ds" / "tokenizer.json").read_text())
    spec["added_tokens"] = []
    spec["model"]["vocab"] = {k: v for k, v in spec["model"]["vocab"].items() if k != EOS}
    bad = _write(tmp_path / "tokenizer.json", json.dumps(spec))
    with pytest.raises(
        DataError,
        match=r"has none of the tokens '<\|endoftext\|>', .*'</s>'.*; "
        r"expected one as the end-of-document \(EOS\) token",
    ):
        prepare_dataset(text_files, tmp_path / "other", seq_length=16, tokenizer=bad)
    with pytest.raises(DataError, match=r"not a valid tokenizer.json"):
        prepare_dataset(
            text_files,
            tmp_path / "other",
            seq_length=16,
            tokenizer=_write(tmp_path / "t.json", "{}"),
        )
    assert not (tmp_path / "other").exists()


def test_a_tokenizer_folder_with_a_llama_eos(text_files, tmp_path):
    prepare_dataset(text_files, tmp_path / "ds", seq_length=16, vocab_size=300)
    text = (tmp_path / "ds" / "tokenizer.json").read_text().replace(EOS, "</s>")
    folder = tmp_path / "llama"
    folder.mkdir()
    _write(folder / "tokenizer.json", text)  # a Hugging Face model folder
    index = prepare_dataset(text_files, tmp_path / "other", seq_length=16, tokenizer=folder)
    assert index["eos_id"] == json.loads(text)["model"]["vocab"]["</s>"]


def _sentencepiece_folder(text_files, folder: Path) -> Path:
    """A Llama tokenizer folder as people have them for Llama 2 or Mistral: a SentencePiece
    tokenizer.model (trained here on the corpus) and its tokenizer_config.json, no
    tokenizer.json."""
    import sentencepiece
    from transformers import LlamaTokenizer

    sentencepiece.SentencePieceTrainer.train(
        input=",".join(map(str, text_files)),
        model_prefix=str(folder.parent / "sp"),
        vocab_size=300,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    LlamaTokenizer(vocab_file=str(folder.parent / "sp.model")).save_pretrained(folder)
    assert (folder / "tokenizer.model").is_file() and not (folder / "tokenizer.json").exists()
    return folder


def test_a_sentencepiece_folder_is_converted_and_its_bos_starts_each_document(text_files, tmp_path):
    """A folder with only tokenizer.model prepares data with the fast tokenizer transformers
    makes of it; the Llama tokenizer puts <s> before every text, so each document starts with
    it (index bos_id) and ends with </s>: the train split's stream equals, id for id,
    <s> + AutoTokenizer's ids + </s> per document (here doc0 and doc1; doc2 is val).
    ``bos="never"`` leaves it out; the trained BPE adds none by default."""
    from transformers import AutoTokenizer

    folder = _sentencepiece_folder(text_files, tmp_path / "llama")
    index = prepare_dataset(
        text_files, tmp_path / "ds", seq_length=16, tokenizer=folder, val_files=["doc2.txt"]
    )
    assert (index["bos_id"], index["eos_id"]) == (1, 2)
    assert Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json")).id_to_token(1) == "<s>"
    reference = AutoTokenizer.from_pretrained(str(folder))
    expected = []
    for path in text_files[:2]:
        expected += [1, *reference(path.read_text(), add_special_tokens=False)["input_ids"], 2]
    stream = np.concatenate(all_samples(tmp_path / "ds", "train", 16)).tolist()
    assert 0 < len(stream) and stream == expected[: len(stream)]
    assert stream.count(1) == 2  # one per document

    index = prepare_dataset(
        text_files,
        tmp_path / "never",
        seq_length=16,
        tokenizer=folder,
        val_files=["doc2.txt"],
        bos="never",
    )
    assert index["bos_id"] is None
    assert 1 not in np.concatenate(all_samples(tmp_path / "never", "train", 16)).tolist()
    assert (
        prepare_dataset(text_files, tmp_path / "bpe", seq_length=16, vocab_size=300)["bos_id"]
        is None
    )
    with pytest.raises(DataError, match="bos=always: .* has none of the begin tokens"):
        prepare_dataset(
            text_files, tmp_path / "always", seq_length=16, vocab_size=300, bos="always"
        )


def test_read_index_errors(tmp_path):
    with pytest.raises(DataError, match=rf"dataset {tmp_path}/nope: no such directory"):
        read_index(tmp_path / "nope")
    with pytest.raises(
        DataError,
        match=r"not a prepared dataset \(no index.json\); run "
        r"`t2train data prepare`",
    ):
        read_index(tmp_path)
    _write(tmp_path / "index.json", "{not json")
    with pytest.raises(DataError, match=r"index.json: malformed"):
        read_index(tmp_path)
    _write(tmp_path / "index.json", json.dumps({"format": "t2train-mds", "version": 1}))
    with pytest.raises(DataError, match=r"malformed \(seq_length=None, expected an integer"):
        read_index(tmp_path)


def _write(path, text):
    path.write_text(text)
    return path


def test_parquet_inputs_stream_rows_as_documents(text_files, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = prepare_dataset(text_files, tmp_path / "first", seq_length=16, vocab_size=300)
    texts = [english_ish(i, 5) for i in range(40)]
    pq.write_table(
        pa.table({"id": list(range(40)), "body": texts}),
        tmp_path / "docs.parquet",
        row_group_size=7,
    )
    index = prepare_dataset(
        [tmp_path / "docs.parquet"],
        tmp_path / "ds",
        seq_length=16,
        text_field="body",
        tokenizer=tmp_path / "first" / "tokenizer.json",
    )
    tok = Tokenizer.from_file(str(tmp_path / "first" / "tokenizer.json"))
    assert index["sources"][0]["documents"] == 40
    assert index["total_tokens"] == sum(len(tok.encode(t).ids) + 1 for t in texts)
    assert index["tokenizer"]["sha256"] == first["tokenizer"]["sha256"]


def test_bad_parquet_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": ["one two", "three"]}), path)
    with pytest.raises(
        DataError,
        match=r"docs.parquet: no column 'text' \(columns: 'body'\); "
        r"choose the text column with --text-field",
    ):
        prepare_dataset([path], tmp_path / "ds", seq_length=4)
    pq.write_table(pa.table({"text": ["one two", None]}), path)
    with pytest.raises(
        DataError,
        match=r"docs.parquet: row 2: column 'text' is null, expected "
        r"a string",
    ):
        prepare_dataset([path], tmp_path / "ds", seq_length=4)
    pq.write_table(pa.table({"text": [1, 2]}), path)
    with pytest.raises(DataError, match=r"column 'text' has type int64, expected string"):
        prepare_dataset([path], tmp_path / "ds", seq_length=4)
    path.write_bytes(b"PAR1 but not really")
    with pytest.raises(DataError, match=r"docs.parquet: not a readable Parquet file"):
        prepare_dataset([path], tmp_path / "ds", seq_length=4)
    assert not (tmp_path / "ds").exists()


def test_invalid_utf8_and_empty_documents_in_binary_parquet_and_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = english_ish(3, 40).encode()
    pq.write_table(
        pa.table({"text": pa.array([words, b"caf\xe9 au lait", b"  "], pa.binary())}),
        tmp_path / "a.parquet",
    )
    (tmp_path / "b.jsonl").write_text('{"text": "   "}\n{"text": "some words here"}\n')
    with pytest.warns(UserWarning, match=r"a.parquet: 1 invalid UTF-8 sequence"):
        index = prepare_dataset(
            [tmp_path / "a.parquet", tmp_path / "b.jsonl"],
            tmp_path / "ds",
            seq_length=8,
            vocab_size=300,
        )
    facts = {Path(s["path"]).name: s for s in index["sources"]}
    assert facts["a.parquet"]["replaced_chars"] == 1
    assert [facts[n]["documents"] for n in ("a.parquet", "b.jsonl")] == [2, 1]
    assert [facts[n]["empty_documents"] for n in ("a.parquet", "b.jsonl")] == [1, 1]


def test_parallel_tokenization_writes_the_same_dataset(text_files, tmp_path):
    one = prepare_dataset(text_files, tmp_path / "one", seq_length=16, vocab_size=300)
    two = prepare_dataset(text_files, tmp_path / "two", seq_length=16, vocab_size=300, workers=2)
    assert one == two
    for split in ("train", "val"):
        shards = sorted((tmp_path / "one" / split).iterdir())
        assert [p.read_bytes() for p in shards] == [
            (tmp_path / "two" / split / p.name).read_bytes() for p in shards
        ]
    with pytest.raises(DataError, match=r"workers=0: must be an integer >= 1"):
        prepare_dataset(text_files, tmp_path / "three", seq_length=16, workers=0)


def test_vocabulary_too_large_for_the_token_column(text_files, tmp_path):
    assert token_dtype(2**16) == "uint16" and token_dtype(2**16 + 1) == "uint32"
    assert token_dtype(2**32) == "uint32"
    with pytest.raises(
        DataError,
        match=r"tokenizer vocabulary of 4294967297 tokens: too large, "
        r"ids above 4294967295 do not fit the uint32 token column",
    ):
        prepare_dataset(text_files, tmp_path / "ds", seq_length=16, vocab_size=2**32 + 1)
    assert not (tmp_path / "ds").exists()


def test_tokenizing_workers_keep_order_and_raise_a_workers_error_here():
    """Two worker processes give each batch's ids in submission order, equal to encoding in
    this process; a batch a worker cannot encode raises its error here, and no worker is left
    running either way (data/tokenize.py)."""
    import multiprocessing

    from tokenizers import models, pre_tokenizers

    from t2train.data.tokenize import encode, encode_batches

    tokenizer = Tokenizer(
        models.WordLevel({"to": 0, "be": 1, "or": 2, "not": 3, "[UNK]": 4}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    others = set(multiprocessing.active_children())
    batches = [
        (index, [("to be " * index, True, False), ("or not", False, True)]) for index in range(7)
    ]
    got = list(encode_batches(tokenizer, 9, "uint16", batches, workers=2, bos=8))
    assert [tag for tag, _ in got] == list(range(7))
    for (_, ids), (_, batch) in zip(got, batches):
        assert ids.tolist() == encode(tokenizer, batch, 9, "uint16", bos=8).tolist()
    assert got[2][1].tolist() == [8, 0, 1, 0, 1, 2, 3, 9]  # BOS before a document, EOS after
    assert encode(tokenizer, batches[2][1], 9, "uint16").tolist() == [0, 1, 0, 1, 2, 3, 9]
    assert set(multiprocessing.active_children()) == others

    with pytest.raises(TypeError):
        list(
            encode_batches(
                tokenizer,
                9,
                "uint16",
                [(0, [("to be", True, True)]), (1, [(7, True, True)])],
                workers=2,
            )
        )
    assert set(multiprocessing.active_children()) == others


BPE_TRAINING = """
import random
from t2train.data.tokenizer import train_tokenizer
letters = "abcdefghijklmnopqrstuvwxyz"
words = ["".join(random.Random(i).choices(letters, k=10)) for i in range(200_000)]
def texts():
    for n in range(200):
        yield " ".join(random.Random(n).choices(words, k=2_000))
    print("read", flush=True)  # the merges (seconds, in Rust) come next
train_tokenizer(texts(), 60_000)
print("trained", flush=True)
"""


def test_ctrl_c_while_bpe_merges_stops_at_once(tmp_path):
    """The merges run in Rust, where Python's signal handlers wait until they end; a Ctrl-C
    during them stops the command within a second all the same."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", BPE_TRAINING],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout.readline() == "read\n"
        time.sleep(0.5)
        pressed = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - pressed
    finally:
        proc.kill()
    assert "trained" not in out, "the merges ended before the Ctrl-C: make the corpus larger"
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err[-2000:]
    assert took < 2, f"{took:.1f} s after Ctrl-C"
