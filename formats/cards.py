"""The formats' declarations read from their source files without running them (no torch).

The byte-copy path (``moetool shard`` / ``repack`` of a dense checkpoint, which starts in
~0.1 s because it never imports torch) must still know every format's tensor suffixes, to
refuse a quantized linear it cannot copy (``moetool.convert.plan.QUANTIZED_ONLY_SUFFIXES``).
Importing the registry would import torch (~1 s), so this module reads the few literal
declarations of each ``@register`` class in ``formats/*.py`` instead: its decorators, class
line and class attributes up to its first method (formats/base.py asks formats to declare
them first, as literals). ``tests/formats`` checks that these cards equal the registry.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

#: the attributes read, with the value of a class that does not declare one
FIELDS = {"name": None, "suffixes": (), "optional_suffixes": (), "quantized": True}

_REGISTER = "\n@register\n"


@cache
def cards() -> tuple[dict, ...]:
    """One dict of ``FIELDS`` per registered format class in formats/, in module order."""
    found = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        start = source.find(_REGISTER)
        while start != -1:
            found.append(_card(_declaration(source[start + 1:]), path))
            start = source.find(_REGISTER, start + 1)
    return tuple(found)


@cache
def quantized_suffixes() -> frozenset[str]:
    """Suffixes that only quantized formats store: every format's (optional ones included)
    but those of the unquantized format (its plain ``weight``)."""
    stored = {s for card in cards() for s in (*card["suffixes"], *card["optional_suffixes"])}
    plain = {s for card in cards() if not card["quantized"] for s in card["suffixes"]}
    return frozenset(stored - plain)


def _declaration(text: str) -> str:
    """The decorators, class line and attribute lines of the class ``text`` starts with."""
    lines: list[str] = []
    in_class = False
    for line in text.splitlines():
        if in_class and (line.startswith(("    def ", "    @"))
                         or line[:1] not in ("", " ", "#")):
            break  # the first method, or the next top-level statement
        in_class = in_class or line.startswith("class ")
        lines.append(line)
    return "\n".join(lines)


def _card(declaration: str, path: Path) -> dict:
    cls = ast.parse(declaration, str(path)).body[0]
    card = dict(FIELDS)
    for node in cls.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in FIELDS and node.value is not None:
            card[target.id] = ast.literal_eval(node.value)
    return card
