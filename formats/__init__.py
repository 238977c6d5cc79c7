"""On-disk weight formats: one module per format in this folder, each registering its class
with ``@register`` (formats/base.py says what a format defines).

``moetool.formats.NAME`` loads the registry (``moetool.formats.registry``: it imports every
module here, and torch) on first use. NAME is a registry name (``FORMATS``, ``get_format``,
``detect_format``, ``linear_format``, ``read_format_params``, ``FormatName``, ``TOLERANCES``,
...) or a public class or function of a format module (``Fp8Block``, ``pack_int4``, ...).
Importing the package alone imports neither: the byte-copy path, which never imports torch,
reads the formats' suffixes from their source (``moetool.formats.cards``).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ below
    from moetool.formats.registry import *  # noqa: F403  (the registry's __all__, as __getattr__ serves it)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    # torch and every format module, on first use only
    registry = importlib.import_module("moetool.formats.registry")
    value = registry.exported(name)
    globals()[name] = value
    return value
