"""The running program instance and the kernel line an op comes from: the lowest layer every other nkisim module
may use (the instance is set by nkisim/runtime.py while it runs a kernel; call sites skip nkisim's own frames)."""
import contextlib
import os
import sys
import threading

_local = threading.local()
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def current(op="nki"):
    inst = getattr(_local, "inst", None)
    if inst is None:
        raise RuntimeError(f"{op}: called outside a running kernel (call the kernel through nki.jit / "
                           f"nki.simulate / nkisim.launch; nkisim executes eagerly inside the launch)")
    return inst


def current_or_none():
    return getattr(_local, "inst", None)


_BASENAMES = {contextlib.__file__: None}   # code filename -> basename, or None for nkisim's own files (and
# contextlib's: a runtime loop's context manager runs between the kernel line and nkisim)


def _kernel_frame():
    """The innermost frame outside nkisim (the kernel line that issued the op), or None."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        b = _BASENAMES.get(fn, 0)
        if b == 0:
            b = _BASENAMES[fn] = None if fn.startswith(_PKG_DIR) else os.path.basename(fn)
        if b is not None:
            return f
        f = f.f_back
    return None


def call_site():
    """file:line of the kernel line that issued the op."""
    f = _kernel_frame()
    return "?" if f is None else f"{_BASENAMES[f.f_code.co_filename]}:{f.f_lineno}"


def kernel_site():
    """(filename, line) of the kernel line that issued the op, or None."""
    f = _kernel_frame()
    return None if f is None else (f.f_code.co_filename, f.f_lineno)


_STACK_STOP = (os.path.join(_PKG_DIR, "runtime.py"), os.path.join(_PKG_DIR, "jit.py"))
_FRAME_NAMES = {}   # (code, line) -> "file:line:function"
STACK_DEPTH = 40    # kernel frames kept in a trace record's "stack": deep enough that the cost model's stage tags
#                   (the outermost stage function, harness/costmodel/layers.py) survive the MoE body's nested
#                   conditional-slot helpers (at 12, a K >= 2 verify's MoE lost its `verify` frame)


def kernel_stack():
    """(loc, stack) of the ISA call being traced: ``loc`` = "file:line" of the innermost kernel frame (outside
    nkisim), ``stack`` = "file:line:function" of the kernel frames from there outwards up to the kernel entry
    (nkisim frames in between, e.g. nl.fori_loop, are skipped), at most STACK_DEPTH."""
    f = sys._getframe(2)
    out = []
    while f is not None and len(out) < STACK_DEPTH:
        code = f.f_code
        fn = code.co_filename
        b = _BASENAMES.get(fn, 0)
        if b == 0:
            b = _BASENAMES[fn] = None if fn.startswith(_PKG_DIR) else os.path.basename(fn)
        if b is None:
            if fn in _STACK_STOP:
                break
        else:
            key = (code, f.f_lineno)
            s = _FRAME_NAMES.get(key)
            if s is None:
                if len(_FRAME_NAMES) > 65536:
                    _FRAME_NAMES.clear()
                s = _FRAME_NAMES[key] = f"{b}:{f.f_lineno}:{code.co_name}"
            out.append(s)
        f = f.f_back
    if not out:
        return call_site(), []
    s = out[0]
    return s[:s.rindex(":")], out


def _where(frame):
    """file:line of the innermost kernel frame (outside nkisim) of a thread's current frame."""
    f = frame
    while f is not None and f.f_code.co_filename.startswith(_PKG_DIR):
        f = f.f_back
    return "?" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
