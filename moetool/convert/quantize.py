"""Library API of ``moetool quantize``: routed experts (and optionally shared experts) go to
the output format; everything else passes through bit-identical (quantized non-expert linears
of another format are written back in the model dtype)."""
from __future__ import annotations

from moetool.convert.conversion import convert_checkpoint
from moetool.convert.plan import Plan, Summary
from moetool.formats import get_format


def quantize(source, out, fmt_name: str, *, group_size: int = 128, symmetric: bool = True, **kw) -> Summary | Plan:
    params = {"group_size": group_size, "symmetric": symmetric} if fmt_name == "int4-group" else {}
    return convert_checkpoint(source, out, fmt=get_format(fmt_name, **params), **kw)


