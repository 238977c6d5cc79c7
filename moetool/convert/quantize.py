"""Library API of ``moetool quantize``: routed experts (and optionally shared experts) go to
the output format; everything else passes through bit-identical (quantized non-expert linears
of another format are written back in the model dtype)."""
from __future__ import annotations

from moetool.convert.conversion import convert_checkpoint
from moetool.convert.plan import Plan, Summary
from moetool.formats import format_params, get_format


def quantize(source, out, fmt_name: str, **kw) -> Summary | Plan:
    """``kw``: the format's parameters (its fields, e.g. group_size; another format's are
    ignored, so one call can pass group_size=64 whatever the format) and
    ``convert_checkpoint``'s options."""
    params, kw = format_params(fmt_name, kw)
    return convert_checkpoint(source, out, fmt=get_format(fmt_name, **params), **kw)


