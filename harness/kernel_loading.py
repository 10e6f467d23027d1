"""Load a kernel function from any file and trace it shape-only: the ``kernel`` command of harness.bench and the
calibration rows of published kernels (harness/costmodel/calibration.py) both use this.

``trace_kernel("FILE::FUNCTION", args=["x=128,512:bfloat16"], ints=["n=4"], floats=["eps=1e-6"], lnc=2, tp=1)``
imports FILE with its package context, fills the function's parameters from the specs (defaults for the rest) and
returns (nkisim trace, function name). Every user error, a kernel nkisim refuses included, is a :class:`BadInput`
with a one-line message.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


class BadInput(Exception):
    """A user error: printed as one line, exit status 2."""


def _parse_shape_dtype(spec, what):
    import nkisim
    from nkisim import dtypes
    if ":" not in spec:
        raise BadInput(f"{what}: expected D0,D1,...:DTYPE, got {spec!r}")
    dims, _, dt = spec.rpartition(":")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise BadInput(f"{what}: shape {dims!r} is not a comma-separated list of integers") from None
    if not shape or min(shape) < 1:
        raise BadInput(f"{what}: every dimension must be >= 1, got {dims!r}")
    try:
        dt = dtypes.normalize(dt, what)
    except Exception:
        raise BadInput(f"{what}: unknown dtype {dt!r} (e.g. bfloat16, float32, int32)") from None
    return nkisim.ShapeDtype(shape, dt)


def _parse_int(spec, what):
    """VALUE -> int; V0,V1,...:DTYPE[:D0xD1] (or range(N):DTYPE...) -> a real integer numpy array."""
    import numpy as np
    parts = spec.split(":")
    try:
        if len(parts) == 1:
            return int(parts[0])
        vals = parts[0]
        if vals.startswith("range(") and vals.endswith(")"):
            arr = np.arange(int(vals[6:-1]))
        else:
            arr = np.array([int(v) for v in vals.split(",")])
        dt = np.dtype(parts[1])
        if dt.kind not in "iu":
            raise BadInput(f"{what}: dtype {parts[1]} is not an integer dtype")
        shape = tuple(int(d) for d in parts[2].split("x")) if len(parts) > 2 else (1, arr.size)
        return arr.astype(dt).reshape(shape)
    except BadInput:
        raise
    except (ValueError, TypeError) as e:
        raise BadInput(f"{what}: cannot read {spec!r} as VALUE or V0,V1,...:DTYPE[:D0xD1] ({e})") from None


def _relative_depth(path):
    """Deepest relative import of a source file (``from ..x import y`` -> 2), 0 when none."""
    import ast
    try:
        tree = ast.parse(Path(path).read_text())
    except (SyntaxError, OSError, UnicodeDecodeError):
        return 0
    return max([n.level for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + [0])


def _import_file(path):
    """Import a kernel file with its package context: it is imported under its dotted package name from the
    first ancestor directory that is not a package (has no __init__.py) and is at least as far up as its deepest
    relative import reaches (namespace packages included), so relative imports work; a file with neither is
    imported as a standalone module, its directory on sys.path."""
    import importlib
    import importlib.util
    path = Path(path).resolve()
    d = path.parent
    parts = [path.stem]
    need = _relative_depth(path)
    while (d / "__init__.py").is_file() or len(parts) <= need:
        parts.insert(0, d.name)
        d = d.parent
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    if len(parts) > 1:
        return importlib.import_module(".".join(parts))
    name = "harness_bench_kernel_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _parse_float(spec, what):
    try:
        return float(spec)
    except ValueError:
        raise BadInput(f"{what}: {spec!r} is not a number") from None


def trace_kernel(target, args=(), ints=(), lnc=1, tp=1, floats=()):
    """(trace, name) of FILE::FUNCTION launched shape-only with ``args`` ["NAME=D0,..:DTYPE"], ``ints``
    ["NAME=VALUE"] and ``floats`` ["NAME=VALUE"]. Raises BadInput for every user error, including a kernel nkisim
    refuses."""
    import inspect

    import nkisim
    nkisim.install()
    import nki
    if "::" not in target:
        raise BadInput(f"kernel: expected FILE::FUNCTION, got {target!r}")
    file, _, fname = target.rpartition("::")
    if not os.path.isfile(file):
        raise BadInput(f"kernel: no such file: {file}")
    if lnc not in (1, 2):
        raise BadInput(f"kernel: --lnc must be 1 or 2, got {lnc}")
    if tp < 1 or tp * lnc > 8:
        raise BadInput(f"kernel: --tp must be 1..{8 // lnc} at LNC={lnc} (one trn2 chip has 8 cores), got {tp}")
    try:
        mod = _import_file(file)
    except Exception as e:          # the file itself fails to import: a user error
        raise BadInput(f"kernel: cannot import {file}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                       ) from None
    fn = getattr(mod, fname, None)
    if fn is None or not callable(fn):
        raise BadInput(f"kernel: {file} has no function {fname!r}")
    kernel = fn if isinstance(fn, nkisim.Kernel) else nki.jit(fn)
    sig = inspect.signature(kernel.fn)
    given = {}
    specs = ([(s, _parse_shape_dtype, "--arg") for s in args] + [(s, _parse_int, "--int") for s in ints] +
             [(s, _parse_float, "--float") for s in floats])
    for spec, parse, flag in specs:
        if "=" not in spec:
            raise BadInput(f"kernel: {flag} expects NAME=..., got {spec!r}")
        name, _, val = spec.partition("=")
        if name not in sig.parameters:
            raise BadInput(f"kernel: {fname} has no parameter {name!r} (parameters: {', '.join(sig.parameters)})")
        if name in given:
            raise BadInput(f"kernel: parameter {name!r} given twice")
        given[name] = parse(val, f"{flag} {name}")
    call = []
    names = list(sig.parameters)
    last = max((names.index(n) for n in given), default=-1)
    for i, (name, p) in enumerate(sig.parameters.items()):
        if i > last and p.default is not inspect.Parameter.empty:
            break
        if name in given:
            call.append(given[name])
        elif p.default is not inspect.Parameter.empty:
            call.append(p.default)
        else:
            raise BadInput(f"kernel: parameter {name!r} of {fname} has no value: give --arg {name}=D0,...:DTYPE or "
                           f"--int {name}=VALUE")
    try:
        with nkisim.trace.capture() as tr:
            if tp > 1:
                nkisim.launch(kernel, [tuple(call)] * tp, tp=tp, lnc=lnc)
            elif lnc == 2:
                kernel[2](*call)
            else:
                kernel(*call)
    except Exception as e:          # a kernel nkisim refuses (or that fails at these shapes): one line
        msg = str(e).splitlines()[0] if str(e) else ""
        raise BadInput(f"kernel: {fname} was refused at these arguments: {type(e).__name__}: {msg[:400]}") from None
    if not tr.instructions:
        raise BadInput(f"kernel: {fname} traced no instruction at these arguments")
    return tr, fname
