"""Stage tags: which stage of a round each traced instruction belongs to.

``predict(trace, stages=...)`` accepts

* ``None`` or ``"file"`` -- the kernel source file of the instruction (``rmsnorm.py``, ``gdn.py``, ...);
* ``"loc"`` -- the source line itself;
* ``"function"`` -- ``file:function`` of the innermost kernel frame (resolved from the source with ``ast``;
  nkisim's ``loc`` is ``file:line`` of the frame that issued the op);
* a dict ``{stage: [glob, ...]}`` matched (fnmatch, first stage wins) against ``file:line`` and
  ``file:function``; unmatched instructions go to ``"other"``;
* a callable ``rec -> stage name``;
* a :class:`StageMarks` filled by ``with marks.stage("D1"): kernel(...)`` around launches inside one
  ``nkisim.trace.capture()`` (an explicit marker: instructions recorded inside the block).
"""
from __future__ import annotations

import ast
import contextlib
import fnmatch
import functools
import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
SEARCH_DIRS = ("nki_kernels", "megakernel", "harness", "tests", "nkisim", "scripts", ".")


class StageMarks:
    """Explicit stage markers on a live ``nkisim.trace.Trace``: records [first, last) instruction
    indices recorded while each ``stage(name)`` block ran."""

    def __init__(self, trace):
        self.trace = trace
        self.ranges = []        # (name, lo, hi)

    @contextlib.contextmanager
    def stage(self, name):
        lo = len(self.trace.instructions)
        try:
            yield
        finally:
            self.ranges.append((name, lo, len(self.trace.instructions)))

    def lookup(self, seq):
        for name, lo, hi in reversed(self.ranges):
            if lo <= seq < hi:
                return name
        return "other"


@functools.lru_cache(maxsize=None)
def _functions_of(filename):
    """[(first line, last line, qualified name)] of the functions in a source file found in the repo."""
    for d in SEARCH_DIRS:
        p = _ROOT / d / filename
        if p.is_file():
            break
    else:
        hits = list(_ROOT.glob(f"**/{filename}"))
        if not hits:
            return ()
        p = hits[0]
    try:
        tree = ast.parse(p.read_text())
    except (SyntaxError, OSError):
        return ()
    out = []

    def visit(node, prefix):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                q = f"{prefix}{ch.name}"
                if not isinstance(ch, ast.ClassDef):
                    out.append((ch.lineno, ch.end_lineno or ch.lineno, q))
                visit(ch, q + ".")
    visit(tree, "")
    return tuple(out)


def function_of(loc: str) -> str:
    """``file:function`` (innermost enclosing function) of a ``file:line`` location."""
    if not loc or ":" not in loc:
        return loc or "?"
    f, _, line = loc.rpartition(":")
    try:
        ln = int(line)
    except ValueError:
        return loc
    best = None
    for lo, hi, q in _functions_of(f):
        if lo <= ln <= hi and (best is None or lo >= best[0]):
            best = (lo, q)
    return f"{f}:{best[1]}" if best else f"{f}:<module>"


def file_of(loc: str) -> str:
    return (loc or "?").rpartition(":")[0] or (loc or "?")


def resolver(stages):
    """A function (seq, rec) -> stage name for any accepted ``stages`` argument."""
    if stages is None or stages == "file":
        return lambda i, rec: file_of(rec.get("loc"))
    if stages == "loc":
        return lambda i, rec: rec.get("loc") or "?"
    if stages == "function":
        return lambda i, rec: function_of(rec.get("loc"))
    if isinstance(stages, StageMarks):
        return lambda i, rec: stages.lookup(rec.get("seq", i))
    if callable(stages):
        return lambda i, rec: stages(rec)
    if isinstance(stages, dict):
        items = [(name, tuple([p] if isinstance(p, str) else p)) for name, p in stages.items()]

        @functools.lru_cache(maxsize=None)
        def match(loc):
            keys = (loc, function_of(loc))
            for name, pats in items:
                if any(fnmatch.fnmatchcase(k, p) for p in pats for k in keys):
                    return name
            return "other"
        return lambda i, rec: match(rec.get("loc") or "?")
    raise TypeError(f"costmodel: stages must be None, 'file', 'loc', 'function', a dict, a callable or "
                    f"StageMarks, got {type(stages).__name__}")


def rel(path):
    try:
        return os.path.relpath(path, _ROOT)
    except ValueError:
        return str(path)
