"""The config reference (t2train/config/reference.py): `t2train config --list [SECTION]` and
docs/config.md, every field with its type, default and meaning from the dataclasses' comments."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path
from typing import ClassVar, Literal, Optional

import pytest

from t2train.cli import main
from t2train.config.reference import (
    REGENERATE,
    format_listing,
    format_markdown,
    reference,
    select,
)
from t2train.config.schema import Config
from t2train.residual.ddl import DDLOptions

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"
NO_MEANING = "(no description yet)"
# Fields still without a comment (a gap: add one beside the field, then drop it from here).
AWAITING_COMMENT: set[str] = set()


def listing(capsys, *args: str) -> str:
    assert main(["config", "--list", *args]) == 0
    return capsys.readouterr().out


def leaf_fields(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted field of ``cls``, found independently of the reference."""
    names = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            names += leaf_fields(kind, f"{prefix}{f.name}.")
        else:
            names.append(f"{prefix}{f.name}")
    return names


def entries(text: str) -> dict[str, tuple[str, str]]:
    """The listing's fields: dotted name -> (its line after the name, its meaning)."""
    found: dict[str, tuple[str, str]] = {}
    lines = text.splitlines()
    for position, line in enumerate(lines):
        if line and not line.startswith((" ", "[")):
            name, _, rest = line.partition("  ")
            meaning = []
            for below in lines[position + 1 :]:
                if not below.startswith("    "):
                    break
                meaning.append(below.strip())
            found[name] = (rest, " ".join(meaning))
    return found


def test_ddl_section_lists_every_option_with_its_meaning(capsys):
    out = listing(capsys, "model.ddl")
    listed = entries(out)
    assert list(listed) == [f"model.ddl.{f.name}" for f in dataclasses.fields(DDLOptions)]
    for name, (_, meaning) in listed.items():
        assert meaning and meaning != NO_MEANING, name
    assert out.startswith("[model.ddl]\n  X <- X + beta k (v^T - k^T X) per sublayer.\n")
    assert "model.ddl.dv  int  default 1\n    state width: 1 = vector state" in out


def test_every_field_of_the_config_has_a_type_and_default(capsys):
    listed = entries(listing(capsys))
    assert list(listed) == leaf_fields()
    for name, (rest, _) in listed.items():
        kind, _, default = rest.partition("  default ")
        assert kind.split(" ")[0] in ("int", "float", "str", "bool"), (name, rest)
        assert default, (name, rest)
    assert listed["model.num_query_groups"][0] == "int or null  default null"
    assert listed["model.tie_embeddings"][0] == "bool (true | false)  default true"
    assert listed["train.lr_decay_style"][0].startswith("str (cosine | linear | constant | wsd)")
    assert listed["model.residual"][0].startswith("str (standard | ddl | ")  # the registry's
    assert listed["data.path"][0] == 'str  default ""'


def test_every_field_has_a_meaning_from_its_comment(capsys):
    """A new field without a comment beside it is a gap in the reference."""
    missing = {
        name for name, (_, meaning) in entries(listing(capsys)).items() if meaning == NO_MEANING
    }
    assert missing <= AWAITING_COMMENT, f"add a comment beside: {sorted(missing)}"


@pytest.mark.parametrize(
    "args, said",
    [
        (["model.nope"], "config --list model.nope: no such section or field; did you mean "),
        (["model.dd"], "did you mean model.ddl? sections: model, model.ddl, "),
        (["--preset", "tiny"], "config --list lists the fields and their defaults; it takes no"),
    ],
)
def test_an_unknown_section_is_a_one_line_error(capsys, args, said):
    assert main(["config", "--list", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: "), captured.err
    assert said in captured.err, captured.err


def test_a_prefix_selects_whole_names_and_single_fields():
    sections = reference()
    assert [f.name for s in select(sections, "train.lr") for f in s.fields] == ["train.lr"]
    model = [s.name for s in select(sections, "model")]
    assert model[:2] == ["model", "model.ddl"] and "parallel" not in model


@dataclasses.dataclass
class Inner:
    """``inner``: a nested section.

    Not this paragraph."""

    # Above, on two
    # lines.
    above: int = 1
    trailing: float = 0.5  # on its line
    skipped: ClassVar[int] = 3  # not a field
    # The next two: covered by this comment, which names the first.
    first: bool = False
    undocumented: str = ""


@dataclasses.dataclass
class Outer:
    choice: Literal["a", "b"] = "a"  # a
    # Spread over
    maybe: Optional[int] = None  # and beside it
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_meanings_come_from_the_comments_above_and_beside_a_field():
    sections = reference(Outer)
    assert [(s.name, s.meaning) for s in sections] == [("", ""), ("inner", "a nested section.")]
    docs = {f.name: f for s in sections for f in s.fields}
    assert list(docs) == [
        "choice",
        "maybe",
        "inner.above",
        "inner.trailing",
        "inner.first",
        "inner.undocumented",
    ]
    assert (docs["choice"].type, docs["choice"].allowed, docs["choice"].default) == (
        "str",
        "a | b",
        "a",
    )
    assert (docs["maybe"].type, docs["maybe"].default) == ("int or null", "null")
    assert docs["maybe"].meaning == "Spread over and beside it"
    assert docs["inner.above"].meaning == "Above, on two lines."
    assert docs["inner.trailing"].meaning == "on its line"
    assert docs["inner.first"].allowed == "true | false"
    assert docs["inner.first"].meaning.startswith("The next two")
    assert docs["inner.undocumented"].meaning == ""  # the comment above names only `first`
    assert NO_MEANING in format_listing(sections)
    assert "| `inner.first` | bool: `true` \\| `false` | `false` |" in format_markdown(sections)


def test_docs_config_md_is_current():
    """docs/config.md is what the dataclasses say now: a field added, removed or commented
    without regenerating the file fails here."""
    assert DOCS.read_text() == format_markdown(reference()), (
        f"docs/config.md is out of date: regenerate it with `{REGENERATE}`"
    )


def test_listing_imports_nothing_heavy(tmp_path):
    """Like the other config-only commands, --list reads the schema without torch."""
    check = (
        "import contextlib, io, sys\n"
        "from t2train.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['config', '--list', 'model.ddl']) == 0\n"
        "from t2train.compat.deferred_import import DeferredModule\n"
        "heavy = {'torch', 'megatron', 'deepspeed', 'streaming', 'transformers'}\n"
        "loaded = {name.split('.')[0] for name, module in sys.modules.items()\n"
        "          if not isinstance(module, DeferredModule)}  # stand-ins load nothing\n"
        "print(sorted(heavy & loaded))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[]"
