"""Pickle a call by value (cloudpickle) without losing where its code came from.

cloudpickle 3.1.3 renames every shipped code object's file to ``<dynamic-code>`` (to make its
payload deterministic). A rank's traceback then points at no file, and the kernel cannot put
the student's cell line under it (its linecache is keyed by the cell's file name). Here each
code object travels with its real file name and gets it back on arrival; on a cloudpickle that
keeps names this is a no-op.
"""

from __future__ import annotations

import functools
import io
import types
from collections import ChainMap


def with_filename(ctor, args, filename: str):
    """Rebuild a code object (cloudpickle's recipe), then give it back its file name."""
    code = ctor(*args)
    return code if code.co_filename == filename else code.replace(co_filename=filename)


@functools.cache
def _pickler_class():
    import cloudpickle

    code_reduce = cloudpickle.Pickler.dispatch_table.get(types.CodeType)

    def reduce_code(code):
        ctor, args = code_reduce(code)  # nested code objects (in co_consts) come back here
        return with_filename, (ctor, args, code.co_filename)

    class CallPickler(cloudpickle.Pickler):
        if code_reduce is not None:
            dispatch_table = ChainMap(
                {types.CodeType: reduce_code}, cloudpickle.Pickler.dispatch_table
            )

    return CallPickler


def dumps(obj) -> bytes:
    """``cloudpickle.dumps(obj)``, keeping each shipped function's file name."""
    buf = io.BytesIO()
    _pickler_class()(buf).dump(obj)
    return buf.getvalue()
