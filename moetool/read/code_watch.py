"""Imported first by the ranks' fork server: from then on it notes what it opens (its imports),
and the ranks forked from it inherit that (:func:`moetool.read.code_files.watch`)."""
from moetool.read import code_files

code_files.watch()
