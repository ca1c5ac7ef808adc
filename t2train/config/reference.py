"""The config reference: every field of ``Config`` with its dotted name, type, allowed values,
default and meaning, for ``t2train config --list [SECTION]`` and ``docs/config.md``.

Generated from the dataclasses themselves (``t2train/config/schema.py`` and the designs'
option sections, ``t2train/residual/*/__init__.py``): the types and defaults from the fields,
the meanings from the source's comments on each field, read with ``inspect``, ``ast`` and
``tokenize``, so that the comment beside a field stays its only description. A field's meaning
is the comment lines directly above it plus any comment on its own lines; a field without one
that the comment of the field just above names (``keep_last``'s names ``keep_every``) shares
that comment. A section's meaning is its class's docstring (its first paragraph).

Light: the schema and the designs' declarations only, no torch (``t2train config --list``
answers as fast as ``--help``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import re
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal, Union

from t2train.config.schema import Config, ConfigError
from t2train.residual import registered

REGENERATE = "t2train config --list --markdown > docs/config.md"


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    name: str  # dotted, as an override names it: model.ddl.dv
    type: str  # int, float, str or bool; "int or null" where null (None) is allowed
    allowed: str  # the choices of a Literal ("auto | sdpa | flash"), "true | false" for a bool
    default: str  # as an override writes it: null, true, 0.02, "" (the empty string)
    meaning: str  # one line, from the field's comments ("" where it has none)


@dataclasses.dataclass(frozen=True)
class SectionDoc:
    name: str  # dotted: "" (the top level), model, model.ddl, ...
    meaning: str  # its class's docstring, first paragraph, as one line
    fields: tuple[FieldDoc, ...]  # its own fields; a nested section is a SectionDoc of its own


def reference(root: type = Config) -> list[SectionDoc]:
    """Every section of ``root`` (top level first, then depth first) with its fields."""
    sections: list[SectionDoc] = []
    _collect(root, "", "", sections)
    return sections


def select(sections: list[SectionDoc], prefix: str) -> list[SectionDoc]:
    """The fields whose dotted name is ``prefix`` or starts with ``prefix.`` (all for "");
    ``ConfigError`` when there are none."""
    if not prefix:
        return sections
    chosen = []
    for section in sections:
        fields = tuple(f for f in section.fields if _under(f.name, prefix))
        if fields:
            chosen.append(dataclasses.replace(section, fields=fields))
    if chosen:
        return chosen
    names = [s.name for s in sections if s.name] + [f.name for s in sections for f in s.fields]
    close = difflib.get_close_matches(prefix, names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(
        f"config --list {prefix}: no such section or field; {hint}sections: "
        f"{', '.join(s.name for s in sections if s.name)}"
    )


def format_listing(sections: list[SectionDoc], width: int = 100) -> str:
    """The terminal listing: per section ``[NAME]`` and its meaning (indented by 2), then per
    field a line ``NAME  TYPE (ALLOWED)  default DEFAULT`` and its meaning (indented by 4),
    wrapped at ``width``."""
    out = []
    for section in sections:
        out.append(f"[{section.name or 'top level'}]")
        out += textwrap.wrap(section.meaning, width, initial_indent="  ", subsequent_indent="  ")
        for f in section.fields:
            kind = f"{f.type} ({f.allowed})" if f.allowed else f.type
            out.append(f"{f.name}  {kind}  default {f.default}")
            meaning = f.meaning or "(no description yet)"
            out += textwrap.wrap(
                meaning,
                width,
                initial_indent="    ",
                subsequent_indent="    ",
                break_long_words=False,
                break_on_hyphens=False,
            )
        out.append("")
    return "\n".join(out)


def format_markdown(sections: list[SectionDoc]) -> str:
    """``docs/config.md``: one table per section."""
    count = sum(len(s.fields) for s in sections)
    out = [
        "# Config reference",
        "",
        "<!-- Generated from the config dataclasses (t2train/config/reference.py); do not",
        "     edit: change the comment beside the field, then regenerate with",
        f"     {REGENERATE}",
        "     (tests/test_config_reference.py checks that this file is current). -->",
        "",
        f"Every field of the config ({count}), with its type, default and meaning. A field is "
        "set by a dotted override (`t2train train ... model.num_layers=8`), in a YAML file "
        "of sections (`--config FILE`) or by a preset (`--preset NAME`); `t2train config "
        "--preset NAME` prints a resolved config, `t2train config --list [SECTION]` this "
        "reference. The fields are declared in `t2train/config/schema.py` and, for the "
        "designs' option sections, in `t2train/residual/<design>/__init__.py`; each is "
        "checked by its section's `validate`.",
        "",
        "Types: `int`, `float`, `str`, `bool` (`true` or `false`); *or null*: `null` is "
        "allowed too. Where a field takes a fixed set of values they are listed.",
        "",
    ]
    for section in sections:
        out.append(f"## {section.name or 'Top level'}")
        out.append("")
        if section.meaning:
            out += [_markdown(section.meaning), ""]
        out.append("| field | type | default | meaning |")
        out.append("|---|---|---|---|")
        for f in section.fields:
            kind = f"{f.type}: {_choices_cell(f.allowed)}" if f.allowed else f.type
            out.append(f"| `{f.name}` | {kind} | `{f.default}` | {_cell(f.meaning)} |")
        out.append("")
    return "\n".join(out)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _collect(cls: type, prefix: str, meaning: str, sections: list[SectionDoc]) -> None:
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    leaves, nested = [], []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            doc = _docstring(kind) or comments.get(f.name, "")
            nested.append((kind, f"{prefix}{f.name}", doc))
            continue
        type_name, allowed = _describe_type(kind)
        allowed = allowed or _registered_choices().get(f"{prefix}{f.name}", "")
        leaves.append(
            FieldDoc(
                name=f"{prefix}{f.name}",
                type=type_name,
                allowed=allowed,
                default=_default(f),
                meaning=comments.get(f.name, ""),
            )
        )
    name = prefix.rstrip(".")
    meaning = re.sub(rf"^`{re.escape(name)}`:?\s*", "", meaning)  # the heading names it
    sections.append(SectionDoc(name, meaning, tuple(leaves)))
    for kind, name, doc in nested:
        _collect(kind, f"{name}.", doc, sections)


def _registered_choices() -> dict[str, str]:
    """The allowed values of the ``str`` fields a registry checks (rather than a Literal)."""
    return {"model.residual": " | ".join(registered())}


def _describe_type(kind: Any) -> tuple[str, str]:
    """(type, allowed values) of a field's resolved annotation."""
    origin = typing.get_origin(kind)
    if origin is Union or origin is types.UnionType:
        options = typing.get_args(kind)
        rest = [option for option in options if option is not type(None)]
        described = [_describe_type(option) for option in rest]
        base = " or ".join(name for name, _ in described)
        allowed = " | ".join(choices for _, choices in described if choices)
        return (f"{base} or null" if len(rest) < len(options) else base), allowed
    if origin is Literal:
        choices = typing.get_args(kind)
        base = " or ".join(dict.fromkeys(type(choice).__name__ for choice in choices))
        return base, " | ".join(_value(choice) for choice in choices)
    if kind is bool:
        return "bool", "true | false"
    return getattr(kind, "__name__", str(kind)), ""


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _value(f.default_factory())
    return "(required)"


def _value(value: Any) -> str:
    """A value as an override or YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return str(value)


def _docstring(cls: type) -> str:
    """The first paragraph of the class's own docstring, as one line ("" if it has none: a
    dataclass without one gets a generated signature, which is not a description)."""
    doc = cls.__dict__.get("__doc__")
    if not doc or doc.startswith(f"{cls.__name__}("):
        return ""
    return _one_line(inspect.cleandoc(doc).split("\n\n")[0].splitlines())


@functools.lru_cache(maxsize=None)
def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> its meaning from the comments of the class that declares it (for an
    inherited field, its base's)."""
    found: dict[str, str] = {}
    for owner in reversed(cls.__mro__):
        if dataclasses.is_dataclass(owner):
            found.update(_own_comments(owner))
    return found


@functools.lru_cache(maxsize=None)
def _own_comments(owner: type) -> dict[str, str]:
    """The comments on the fields ``owner`` declares itself, read from its source."""
    try:
        lines, _ = inspect.getsourcelines(owner)
    except (OSError, TypeError):  # no source (e.g. a class built at run time)
        return {}
    source = textwrap.dedent("".join(lines))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whether alone on its line)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            alone = not token.line[: token.start[1]].strip()
            comments[token.start[0]] = (token.string.lstrip("#").strip(), alone)
    declared = set(owner.__dict__.get("__annotations__", {}))
    fields = {f.name for f in dataclasses.fields(owner)}
    own: list[tuple[str, str]] = []  # (field, its comment) in source order
    statements = ast.parse(source).body[0]
    assert isinstance(statements, ast.ClassDef)
    for statement in statements.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        name = statement.target.id
        if name not in declared or name not in fields:  # e.g. a ClassVar
            continue
        above: list[str] = []
        line = statement.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        end = statement.end_lineno or statement.lineno
        inside = [comments[n][0] for n in range(statement.lineno, end + 1) if n in comments]
        own.append((name, _one_line(above + inside)))
    meanings: dict[str, str] = {}
    above_text = ""
    for name, text in own:
        if not text and _names(above_text, name):
            text = above_text  # the comment of the field above covers this one too
        meanings[name] = above_text = text
    return meanings


def _names(comment: str, field_name: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(field_name)}(?!\w)", comment) is not None


def _one_line(lines: list[str]) -> str:
    """Comment or docstring lines as one line; reST's ``code`` becomes Markdown's `code`."""
    text = ""
    for line in (line.strip() for line in lines):
        if line:
            text += ("" if not text or re.search(r"\w/$", text) else " ") + line  # a path
    return text.replace("``", "`")


def _markdown(text: str) -> str:
    """Comment text as Markdown: a ``<`` outside code escaped (``<run_dir>`` is no HTML tag)."""
    parts = text.split("`")
    return "`".join(
        part if odd % 2 else part.replace("<", "&lt;") for odd, part in enumerate(parts)
    )


def _cell(text: str) -> str:
    """Text for a Markdown table cell: its pipes escaped (in code too: GFM tables split there)."""
    return _markdown(text).replace("|", "\\|")


def _choices_cell(allowed: str) -> str:
    """``auto | sdpa | flash`` as a table cell: each choice as code."""
    return " \\| ".join(f"`{choice}`" for choice in allowed.split(" | "))
