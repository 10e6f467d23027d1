"""Front-end lint: Python the NKI 0.6 front end does not accept, found in the kernel and in the helpers it runs.

The NKI <= 0.6 front end specialises a kernel with dedicated lowering passes over a *subset* of Python, and it
processes every function the kernel calls (all calls are inlined at specialisation, SDK language guide
"Compilation Model"). nkisim runs the code with CPython, so it checks the source instead:

* **errors** (documented rejections, SDK-MIG 0.3.0 "Language Restrictions" / SDK-RN 2.29): ``is`` / ``is not``,
  and dict literals with non-string keys, in the ``@nki.jit`` function (jit._lint_source) and -- with
  ``HELPER_ERRORS`` -- in the helpers it calls.
* **warnings** (:class:`NkiFrontendWarning`; evidence of rejection is not official for 0.6): list / set / dict
  comprehensions, generator expressions, generator functions (``yield``) and ``lambda``. The project's
  ../shared/docs/trn2-costs.md reports "list comprehensions and inner defs are rejected by the NKI frontend", and the
  NKI 0.7.0 release notes say the new tracing front end now accepts "constructs the previous specialization did
  not support, such as generators". No 0.6 document lists comprehensions or lambdas as rejected.
* **inner defs are accepted** (no lint): the 0.6 runtime loops take a body callable
  (``nl.fori_loop(lower, upper, body_fun)``), and NKI 0.6 kernels of AWS's NKI library and of public projects that
  compile with neuronx-cc 2.27 define those bodies as inner ``def``\\ s.

Helpers are found at run time: on every ISA call the kernel frames on the call stack (outside nkisim, the standard
library and site-packages) not walked before are visited and their code linted, once per code object (see
check_stack: typically one or two frames per call). Each finding is reported once. A kernel whose last
QUIET_AFTER launches ran no code not linted before is no longer walked (repeated launches cost nothing).
Switches: ``nkisim.jit.FRONTEND_LINT`` (all front-end checks), ``HELPER_LINT`` (helpers), ``HELPER_ERRORS``.
"""
import ast
import os
import sys
import sysconfig
import warnings

from .errors import NkiFidelityWarning, NkiValidationError

HELPER_LINT = True        # lint the helpers a kernel runs (warnings; errors too if HELPER_ERRORS)
HELPER_ERRORS = False     # True: 'is' / non-string dict keys in a helper are errors, as in the kernel body


class NkiFrontendWarning(NkiFidelityWarning):
    """Python the NKI 0.6 front end probably rejects (see nkisim.frontend)."""


_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_SKIP_DIRS = tuple({p for p in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib"),
                                sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"))
                    if p} | {_PKG_DIR})
_STOP = (os.path.join(_PKG_DIR, "runtime.py"), os.path.join(_PKG_DIR, "jit.py"))

_state = {}      # code object -> 1 at the launch boundary (stop the walk), 0 once linted / not kernel code
_linted_count = [0]          # kernel code objects linted so far (a launch that adds none found nothing new)
_quiet = {}                  # kernel code object -> consecutive launches that linted no new code
QUIET_AFTER = 2              # after that many such launches a kernel's helpers are no longer walked


def launch_begin(kernel_code):
    """Whether this launch walks helper frames, and the state launch_end needs."""
    on = HELPER_LINT and _quiet.get(kernel_code, 0) < QUIET_AFTER
    return on, _linted_count[0]


def launch_end(kernel_code, state):
    on, before = state
    if on:
        _quiet[kernel_code] = 0 if _linted_count[0] != before else _quiet.get(kernel_code, 0) + 1
_trees = {}      # filename -> parsed module (or None)
_reported = set()


def _is_kernel_file(fn):
    return not (fn.startswith(_SKIP_DIRS) or fn.startswith("<") or "site-packages" in fn)


def check_stack(frame, seen):
    """Lint every not-yet-seen kernel code object on the stack from ``frame`` out to the kernel entry.

    ``seen`` (per program instance) maps id(frame) -> (code, id(caller frame), caller code) of frames already
    walked: the walk stops at the first frame recorded with the same code and the same caller (its callers were
    walked then), so a kernel issuing many ISA calls from the same frames walks one or two frames per call. (An
    address reused by a new frame only matches if its code and its caller's frame and code match too.)"""
    f = frame
    st = _state
    while f is not None:
        code = f.f_code
        s = st.get(code)
        if s is None:
            fn = code.co_filename
            s = st[code] = 1 if fn in _STOP else 0
            if not s and _is_kernel_file(fn):
                _linted_count[0] += 1
                try:
                    _lint_code(code)
                except NkiValidationError:
                    del st[code]     # refused (HELPER_ERRORS): refuse it again at the next launch too
                    raise
        if s:
            return
        b = f.f_back
        bc = None if b is None else b.f_code
        rec = seen.get(id(f))
        if rec is not None and rec[0] is code and rec[1] == id(b) and rec[2] is bc:
            return
        seen[id(f)] = (code, id(b), bc)
        f = b


def _module_tree(filename):
    t = _trees.get(filename, 0)
    if t == 0:
        try:
            with open(filename) as fh:
                t = ast.parse(fh.read(), filename)
        except (OSError, SyntaxError, ValueError):
            t = None
        _trees[filename] = t
    return t


def _function_node(tree, code):
    name, line = code.co_name, code.co_firstlineno
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.name == name and (node.lineno == line or first == line):
                return node
    return None


def _lint_code(code):
    if code.co_name in ("<module>", "<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"):
        return
    tree = _module_tree(code.co_filename)
    if tree is None:
        return
    if code.co_name == "<lambda>":        # a lambda run as kernel code: itself the finding
        where = os.path.basename(code.co_filename)
        _warn_once(code.co_filename, code.co_firstlineno, "a lambda", "kernel code", "(a lambda)", where,
                   "the NKI <= 0.6 front end specialises a subset of Python and may reject it (use a named def; see "
                   "nkisim.frontend)")
        for node in ast.walk(tree):
            if isinstance(node, ast.Lambda) and node.lineno == code.co_firstlineno:
                lint_node(node, "<lambda>", code.co_filename, 0, helper=True)
        return
    node = _function_node(tree, code)
    if node is not None:
        lint_node(node, code.co_name, code.co_filename, 0, helper=True)


_WARN = ((ast.ListComp, "a list comprehension"), (ast.SetComp, "a set comprehension"),
         (ast.DictComp, "a dict comprehension"), (ast.GeneratorExp, "a generator expression"),
         (ast.Lambda, "a lambda"), (ast.Yield, "a generator function (yield)"),
         (ast.YieldFrom, "a generator function (yield from)"))


def lint_node(tree, fname, filename, line_offset, helper):
    """Errors / warnings for one function's AST (``line_offset`` maps tree lines to file lines)."""
    where = os.path.basename(filename)
    kind = "helper" if helper else "kernel"
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0) + line_offset
        if isinstance(node, ast.Compare):
            for o in node.ops:
                if isinstance(o, (ast.Is, ast.IsNot)):
                    word = "is not" if isinstance(o, ast.IsNot) else "is"
                    if helper and not HELPER_ERRORS:
                        _warn_once(filename, line, f"'{word}'", kind, fname, where,
                                   "the NKI compiler rejects 'is'/'is not' (NKI 0.3.0 Language Restrictions) and the "
                                   "front end processes every function the kernel calls: use == / !=")
                        continue
                    raise NkiValidationError(
                        f"nki.jit: {kind} {fname} uses '{word}' at {where}:{line}; the NKI compiler rejects 'is'/'is "
                        f"not' (NKI 0.3.0 update guide, Language Restrictions; the front end processes every function "
                        f"the kernel calls): use == / != instead (e.g. 'x == None')")
        elif isinstance(node, ast.Dict):
            for k in node.keys:
                if isinstance(k, ast.Constant) and not isinstance(k.value, str):
                    if helper and not HELPER_ERRORS:
                        _warn_once(filename, line, f"dict key {k.value!r}", kind, fname, where,
                                   "NKI dict keys must be strings (NKI 0.3.0)")
                        continue
                    raise NkiValidationError(
                        f"nki.jit: {kind} {fname} builds a dict with key {k.value!r} at {where}:{line}; NKI dict keys "
                        f"must be strings (NKI 0.3.0)")
        if node is tree:
            continue
        for cls, what in _WARN:
            if isinstance(node, cls):
                _warn_once(filename, line, what, kind, fname, where,
                           "the NKI <= 0.6 front end specialises a subset of Python and may reject it (write an "
                           "explicit loop / a named def; see nkisim.frontend)")
                break


def _warn_once(filename, line, what, kind, fname, where, why):
    key = (filename, line, what)
    if key not in _reported:
        _reported.add(key)
        warnings.warn(f"nki.jit: {kind} {fname} uses {what} at {where}:{line}; {why}", NkiFrontendWarning, stacklevel=3)

