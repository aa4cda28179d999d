"""YAML as fedhet reads every file (configs, sweep files, run records) and every ``--set`` value:
a key given twice is an error, ``5e-1`` is a number, and libyaml parses where it reads a text as
PyYAML's own parser does. :func:`read_yaml` reads a file with errors that say what is wrong.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from fedhet.core.errors import ConfigError


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML as users write it: a key given twice in one mapping is an error (PyYAML keeps the last
    silently, so a second ``train:`` section would replace the first), and ``5e-1`` or ``1e3`` are
    numbers (PyYAML follows YAML 1.1, which wants ``5.0e-1``: ``5e-1`` was the string "5e-1", which
    typed keys such as ``train.lr`` converted but a partitioner's own parameters did not)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"the key {key!r} appears twice (first at line "
                    f"{seen[key].line + 1}): merge the two into one", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


# PyYAML's pure-Python parser takes ~10 ms for a run's config (a sweep table of a thousand runs was
# mostly that); libyaml's, where PyYAML has it, builds the same objects through the same constructors
# and resolvers in a tenth of the time. The two parsers part ways on a few texts (found by running both
# on generated ones): PyYAML refuses a tab after a value or between tokens where libyaml skips it, reads
# the empty tag `!` and `?` in flow collections otherwise, refuses a comment right after a block
# scalar's `|` or `>`, keeps a byte-order mark inside the text, and only it reports a lone surrogate as
# a YAML error. A text holding any of these characters goes to PyYAML alone, as does every text
# libyaml refuses: what parse_yaml returns or raises is PyYAML's.
_PYYAML_ONLY = re.compile(r"[\t!|>?\ufeff\ud800-\udfff]")

if yaml.__with_libyaml__:
    from yaml.cyaml import CParser

    class _LibyamlUniqueKeyLoader(CParser, UniqueKeyLoader):
        """:class:`UniqueKeyLoader` (its duplicate-key check, its float resolver, SafeLoader's
        constructors) on libyaml's parser, as ``yaml.CSafeLoader`` is built."""

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)


def _parse_yaml_pure(text: str) -> Any:
    """``parse_yaml`` on PyYAML's pure-Python parser only: what parse_yaml returns or raises."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_yaml(text: str) -> Any:
    """YAML text as fedhet reads every file and ``--set`` value (:class:`UniqueKeyLoader`): through
    libyaml where PyYAML has it and the text is one both parsers read alike, else PyYAML's own
    parser, whose error is raised."""
    if yaml.__with_libyaml__ and isinstance(text, str) and not _PYYAML_ONLY.search(text):
        try:
            return yaml.load(text, Loader=_LibyamlUniqueKeyLoader)  # noqa: S506 - SafeLoader's constructors
        except yaml.YAMLError:
            pass                         # PyYAML's own error, below
    return _parse_yaml_pure(text)


def read_yaml(path: Path, what: str) -> Any:
    """The parsed YAML of ``path``, or a ConfigError saying it is missing or malformed."""
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder, not a file: name the .yaml file inside it")
    if not path.is_file():
        where = "" if path.is_absolute() else f" (a relative path, read from the working directory {Path.cwd()})"
        raise ConfigError(f"{what} {path} does not exist{where}")
    content = path.read_bytes()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        line = content[:e.start].count(b"\n") + 1
        raise ConfigError(f"{what} {path} is not UTF-8 text: byte 0x{content[e.start]:02x} on line {line} cannot be "
                          "read; save the file as UTF-8 (an accented comment saved as Latin-1 does this), or name "
                          "the YAML file if this is another kind of file") from None
    if "\x00" in text:
        raise ConfigError(f"{what} {path} holds NUL bytes: it is a binary file, not YAML text")
    try:
        parsed = parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {yaml_problem(e)}") from None
    refuse_glued_colon(parsed, str(path))
    return parsed


def refuse_glued_colon(obj: Any, where: str) -> None:
    """A ConfigError at ``where`` for a mapping key in ``obj`` written ``key:value`` without the
    space YAML needs (:func:`glued_colon`)."""
    if (glued := glued_colon(obj)) is not None:
        name, _, value = glued.partition(":")
        raise ConfigError(f"{where}: {glued!r} reads as one key with no value: YAML needs a space after the "
                          f"colon, write {{{name}: {value}}}")


def glued_colon(obj: Any) -> str | None:
    """The first mapping key in ``obj`` that reads as ``key:value`` written without the space YAML
    needs after a colon (``{kind:iid}`` is the one key ``'kind:iid'`` with no value), else None."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if v is None and isinstance(k, str) and ":" in k.strip(":") and " " not in k:
                return k
            if (found := glued_colon(v)) is not None:
                return found
    elif isinstance(obj, list):
        for v in obj:
            if (found := glued_colon(v)) is not None:
                return found
    return None


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error as one line with its line and column in the file (PyYAML names the file
    ``<unicode string>``), the text it stopped at, and the usual fix for a tab."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or problem is None:
        return str(e)
    context = getattr(e, "context", None)
    said = f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")
    if "'\\t'" in problem:
        said += "; YAML indents with spaces, not tabs"
    snippet = mark.get_snippet()
    return said + (f"\n{snippet}" if snippet else "")
