"""moetool: convert Mixture-of-Experts checkpoints and prove the result is right."""
import importlib.util
import os
import sys

from moetool.errors import MoetoolError

__version__ = "0.1.0"
__all__ = ["MoetoolError", "__version__"]

#: subpackages that live beside this package in the source tree (``formats/``, ``kernels/``)
#: and install as ``moetool.<name>`` through pyproject.toml's ``package-dir``
TOP_LEVEL_SUBPACKAGES = ("formats", "kernels")


class _SourceTreeFinder:
    """Finds ``moetool.formats`` / ``moetool.kernels`` in the source tree's top-level folders.

    A wheel holds them inside ``moetool/``, and a PEP 660 editable install maps them with its
    own finder, so this one is never asked there. A legacy editable install (``setup.py
    develop``, ``editable_mode=compat``) or a bare ``PYTHONPATH=<repo>`` only puts the repo root
    on ``sys.path``, where nothing maps them: this finder does, for exactly these names."""

    def __init__(self, root: str):
        self.moetool_source_tree = root

    def find_spec(self, fullname, path=None, target=None):
        pkg, _, name = fullname.partition(".")
        if pkg != __name__ or name not in TOP_LEVEL_SUBPACKAGES:
            return None
        folder = os.path.join(self.moetool_source_tree, name)
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                       submodule_search_locations=[folder])


def _map_source_tree_subpackages() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if any(os.path.isdir(os.path.join(here, name)) for name in TOP_LEVEL_SUBPACKAGES):
        return  # installed: they are inside the package
    root = os.path.dirname(here)
    if not os.path.isfile(os.path.join(root, "pyproject.toml")) or not all(
            os.path.isfile(os.path.join(root, name, "__init__.py")) for name in TOP_LEVEL_SUBPACKAGES):
        return  # not our source tree
    if not any(getattr(f, "moetool_source_tree", None) == root for f in sys.meta_path):  # once (a reload too)
        sys.meta_path.append(_SourceTreeFinder(root))  # last: an editable install's own finder comes first


_map_source_tree_subpackages()
