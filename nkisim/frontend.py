"""Front-end rules: the Python a kernel may use, the classes and globals it may reach, the API names it may read.

The NKI front end specialises a kernel by interpreting a *subset* of Python, and it processes every function the
kernel calls (SDK nki-language-guide.rst "Compilation Model": "All function calls are inlined at specialization
time"). nkisim runs the code with CPython, so it checks the source and the objects the code reaches. Every traced
function is covered:

* the ``@nki.jit`` function and every function it *references* -- module globals (``helper(...)``,
  ``mod.helper(...)``) resolved in the function's globals, recursively, the methods of the classes it references,
  functions passed as kernel arguments -- found statically (``reach``), once per code object;
* every kernel frame on the call stack at an ISA call (``check_stack``: closures and other dynamic calls).

Rules (the README table "Rules enforced" lists them with their sources):

errors (documented)
  * ``is`` / ``is not``, dict literals with non-string keys, in the ``@nki.jit`` function (SDK-MIG 0.3.0 "Language
    restrictions"; SDK-LG "NKI Values": "Dictionaries with string-value keys"). In helpers they are warnings: AWS's
    nki-library (release 2.29 = NKI 0.3.0, tested by compiling and running on hardware) uses ``x is None`` /
    ``x is not None`` in helpers its kernels execute (86 files, e.g. core/utils/kernel_helpers.py ``reduce``, called
    by core/cumsum), which the compiler evidently accepts. ``HELPER_ERRORS`` = True makes them errors.
  * classes (SDK-LG "Class Support"): a user class reaching traced code -- an argument, a global or closure value
    read by traced code, or a class a traced function names (e.g. to build an object) -- must inherit from
    ``NKIObject`` and no other class (a single-inheritance chain of such classes is accepted); enumerations derive
    from ``Enum`` alone (SDK-LG "Enumerations"). Only the object dictionary crosses ("NKI does not look at slots or
    other object features, only the object dictionary"): ``__slots__`` and properties / other data descriptors are
    refused (frozen dataclasses are accepted: nki-library passes them). Switch ``CLASS_RULE``.
  * undocumented names of the API: ``nl.X`` / ``nisa.X`` / ``ncc.X`` / ``nki.X`` that is not in the NKI 0.6
    public interface (nkisim/public_api.py, from ../shared/docs/nki-api-0.6.json), nkisim internals imported
    directly, and undocumented attributes of API objects (``ReplicaGroup.groups``, ``VirtualRegister.value``,
    ``NkiTensor.storage``, ...) read by kernel code. Switch ``API_RULE``.

warnings (NkiFrontendWarning: only third-party evidence, or the docs leave it open)
  * list / set / dict comprehensions, generator expressions and functions, ``lambda`` (../shared/docs/trn2-costs.md:
    "list comprehensions and inner defs are rejected by the NKI frontend"; SDK-RN 0.7.0 says the new tracing front end
    now accepts "constructs the previous specialization did not support, such as generators");
  * inner ``def``\\ s other than runtime-loop bodies (trn2-costs.md; a ``def`` passed to ``nl.fori_loop`` /
    ``nl.while_loop`` is the documented 0.6 form and is fine);
  * the forms the open-source KLR front end refuses (``klr_form``; switch ``nkisim.hw.KLR_FORMS``): a ``for`` target
    that is not a single name, a tuple target holding an attribute / subscript, a chained assignment with more than
    one attribute / subscript target, ``enumerate`` / ``zip``, ``for`` / ``while`` ... ``else``, a ``with`` other than
    one argument-less call (leanprover/KLR KLR/NKI/Simplify.lean, KLR/Trace/Python.lean; nki-library's kernels use
    none of them);
  * ``try`` statements, ``global`` / ``nonlocal`` statements, ``*args`` / ``**kwargs`` / keyword-only parameters of
    helpers (SDK-MIG 0.3.0 refuses them in kernel signatures; helpers are not named);
  * purity (SDK-LG "Kernel Caching": kernels "must be pure functions of their arguments"; SDK-RN 0.3.0 Known Issues:
    depending on "global variables or closures over mutable objects" is "undefined behavior" *when the state
    changes*, as the cache may return a stale kernel): traced code reading a mutable module global (list, dict, set,
    array, object) or a mutable closure value of the kernel function. Warned, not refused: the compiler accepts it
    and nkisim cannot know whether the state changes between launches. Switch ``PURITY``.

Each finding is reported once. Switches: ``nkisim.jit.FRONTEND_LINT`` (all front-end checks), ``HELPER_LINT``
(helpers), ``HELPER_ERRORS``, ``CLASS_RULE`` / ``API_RULE`` ("error" | "warn" | "off"), ``PURITY`` ("warn" | "error" |
"off"). A kernel whose last QUIET_AFTER launches ran no code not linted before is no longer walked at ISA calls.
"""
import ast
import dis
import enum
import inspect
import os
import sys
import sysconfig
import types
import warnings

import numpy as np

from . import hw, public_api
from .errors import NkiFidelityWarning, NkiValidationError

HELPER_LINT = True        # lint the helpers a kernel runs
HELPER_ERRORS = False     # True: 'is' is an error in helpers too (see the docstring)
CLASS_RULE = "error"      # user classes reaching traced code (SDK-LG "Class Support")
API_RULE = "error"        # undocumented API names / attributes
PURITY = "warn"           # traced code reading mutable module globals / closure state (SDK-LG "Kernel Caching")
DICT_KEYS = "error"       # dicts with non-string keys in traced frames (SDK-LG "NKI Values"); "off"
DICT_KEYS_DOC = ("NKI dict keys must be strings (SDK nki-language-guide.rst 'NKI Values': 'Dictionaries with "
                 "string-value keys', 'the keys must be string values'; NKI 0.3.0 update guide)")


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
_reached = set()             # code objects whose references were followed (reach)
_classes = {}                # class -> None (legal) or the refusal message
_trees = {}                  # filename -> parsed module (or None)
_reported = set()
_frame_checked = set()       # code objects whose API-attribute reads were type-checked against a live frame


def launch_begin(kernel_code):
    """Whether this launch walks helper frames, and the state launch_end needs."""
    on = HELPER_LINT and _quiet.get(kernel_code, 0) < QUIET_AFTER
    return on, _linted_count[0]


def launch_end(kernel_code, state):
    on, before = state
    if on:
        _quiet[kernel_code] = 0 if _linted_count[0] != before else _quiet.get(kernel_code, 0) + 1


def _is_kernel_file(fn):
    return not (fn.startswith(_SKIP_DIRS) or fn.startswith("<") or "site-packages" in fn)


def _short(filename, line):
    return f"{os.path.basename(filename)}:{line}"


# ---- launch entry: arguments, the kernel's closure, static reachability -------------------------------------------
def check_launch(fn, per_rank_args, per_rank_kwargs):
    """At every launch (runtime.run): the arguments' values (classes, 32-bit ints, tensor sizes), the kernel
    function's closure, and the functions it references (once per code object)."""
    if not sys.modules[__package__ + ".jit"].FRONTEND_LINT:
        return
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__name__", "kernel")
    seen = set()
    for args, kws in zip(per_rank_args, per_rank_kwargs):
        for i, a in enumerate(args):
            _check_argument(a, f"argument #{i} of kernel {name}", seen)
        for k, a in kws.items():
            _check_argument(a, f"argument '{k}' of kernel {name}", seen)
    if code is None:
        return
    for var, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        where = f"kernel {name} ({_short(code.co_filename, code.co_firstlineno)}) closes over '{var}'"
        _check_value(v, var, where, code, code.co_firstlineno, closure=True)
    reach(code, fn.__globals__, f"kernel {name}")


def _check_argument(x, what, seen):
    from . import int32
    from .tensor import NkiTensor
    t = type(x)
    if t is int:
        int32.check(x, what)
    elif t is NkiTensor:
        st = x.storage
        if st.id not in seen:
            seen.add(st.id)
            int32.check_size(st)
    elif t is tuple or t is list:
        for i, v in enumerate(x):
            _check_argument(v, f"{what}[{i}]", seen)
    elif t is dict:
        for k, v in x.items():
            if not isinstance(k, str):
                _dict_key_fail(f"{what} is a dict with the non-string key {k!r}")
            _check_argument(v, f"{what}[{k!r}]", seen)
    elif isinstance(x, types.FunctionType):
        if _is_kernel_file(x.__code__.co_filename):
            reach(x.__code__, x.__globals__, f"{x.__name__} (passed as {what})")
    elif _user_class(t):
        class_rule(t, what)
        if id(x) not in seen:
            seen.add(id(x))
            for k, v in vars(x).items() if hasattr(x, "__dict__") else ():
                _check_argument(v, f"{what}.{k}", seen)


# ---- static reachability ----------------------------------------------------------------------------------------
def reach(code, globals_, via):
    """Lint ``code`` (a kernel / helper function) and, recursively, every function and class it references through
    its module globals. ``via`` names how the code was reached (for messages). Cached per code object."""
    if code in _reached or not _is_kernel_file(code.co_filename):
        return
    _reached.add(code)
    try:
        _lint_code(code, is_kernel=via.startswith("kernel "))
        for name, attrs, line, sub in _global_refs(code):
            if name in globals_:                 # (builtins and unbound names are not followed)
                _check_global(globals_[name], name, attrs, sub, line)
    except NkiValidationError:
        _reached.discard(code)                   # refused: refuse it again at the next launch too
        raise


_MUTABLE = (list, dict, set, bytearray, np.ndarray)


def _check_global(obj, name, attrs, code, line):
    """A module global ``name`` (then ``.attrs``) read by traced ``code`` at ``line``."""
    where = f"{code.co_name} ({_short(code.co_filename, line)})"
    if isinstance(obj, types.ModuleType):
        api = _api_module_name(obj)
        if api is not None:
            if attrs:
                _check_api_chain(api, obj, attrs, name, where)
            return
        mf = getattr(obj, "__file__", None) or ""
        if mf.startswith(_PKG_DIR):
            _api_fail(f"{where} uses module '{obj.__name__}' (nkisim's own implementation); kernels import only the "
                      f"NKI API (nki, nki.language, nki.isa, nki.collectives)")
        if attrs and mf and _is_kernel_file(mf) and hasattr(obj, attrs[0]):
            _check_value(getattr(obj, attrs[0]), f"{name}.{attrs[0]}", f"{where} reads {name}.{attrs[0]}", code, line)
        return
    _check_value(obj, name, f"{where} reads global '{name}'", code, line)


def _check_value(obj, label, where, code, line, closure=False):
    """A value traced code gets from outside the kernel (a global or a closure cell)."""
    t = type(obj)
    if isinstance(obj, types.FunctionType):
        fc = obj.__code__
        if fc.co_filename.startswith(_PKG_DIR):
            if id(obj) not in _public_ids():
                _api_fail(f"{where}: '{label}' is nkisim's internal {obj.__module__}.{obj.__qualname__}, not part of "
                          f"the NKI 0.6 API (../shared/docs/nki-api-0.6.json)")
            return
        if _is_kernel_file(fc.co_filename):
            reach(fc, obj.__globals__, f"{obj.__name__} (referenced by {where})")
        return
    if isinstance(obj, type):
        if obj.__module__.startswith("nkisim"):
            if id(obj) not in _public_ids():
                _api_fail(f"{where}: '{label}' is nkisim's internal class {obj.__module__}.{obj.__qualname__}, not "
                          f"part of the NKI 0.6 API (../shared/docs/nki-api-0.6.json)")
            return
        if _user_class(obj):
            class_rule(obj, where)
        return
    if _user_class(t):
        class_rule(t, f"{where} (a {t.__name__} object)")
        if not isinstance(obj, enum.Enum):
            _purity(code, line, label, f"a {t.__name__} object", where, closure)
        return
    if isinstance(obj, _MUTABLE):
        _purity(code, line, label, f"a {t.__name__}", where, closure)
        bad = _bad_key(obj)
        if bad is not None:
            _global_dict_key(code, line, label, where, bad)
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, set)) else ()
        for i, v in enumerate(items):
            if i >= 64:
                break
            if _user_class(type(v)):
                class_rule(type(v), f"{where} (an element, a {type(v).__name__} object)")


def _purity(code, line, label, what, where, closure):
    if PURITY == "off":
        return
    kind = "closure variable" if closure else "module global"
    msg = (f"nki.jit: kernel purity: {where}: {kind} '{label}' is {what}, mutable state outside the kernel's arguments. NKI kernels "
           f"must be pure functions of their arguments (SDK nki-language-guide.rst 'Kernel Caching'): the compiled "
           f"kernel is cached by its arguments, so a change to this state later returns a stale kernel (SDK-RN 0.3.0 "
           f"Known Issues: 'undefined behavior'). Pass it as a kernel argument, or make it an immutable constant "
           f"(tuple, int, str) (switch: nkisim.frontend.PURITY)")
    if PURITY == "error":
        raise NkiValidationError(msg)
    key = (code.co_filename, line, "purity:" + label)
    if key not in _reported:
        _reported.add(key)
        warnings.warn(msg, NkiFrontendWarning, stacklevel=4)


def _global_refs(code):
    """(global name, (attr, ...), line, code object) for every global load in ``code`` and its nested code objects
    (inner defs, lambdas, comprehensions); attrs are the attribute names read right after it (at most 2)."""
    out = []
    stack = [code]
    while stack:
        c = stack.pop()
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        ins = list(dis.get_instructions(c))
        line = c.co_firstlineno
        for j, i in enumerate(ins):
            if i.positions is not None and i.positions.lineno:
                line = i.positions.lineno
            if i.opname != "LOAD_GLOBAL":
                continue
            attrs = []
            for k in ins[j + 1:j + 3]:
                if k.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
                    break
                attrs.append(k.argval)
            out.append((i.argval, tuple(attrs), line, c))
    return out


# ---- the public API ----------------------------------------------------------------------------------------------
# The API modules and classes register themselves when they are imported (nkisim/language.py, isa/__init__.py,
# isa/common.py, collectives.py, typing.py; shim.py registers the ``nki`` package), so this checker, which the runtime
# below the API uses, imports none of them.
_API_MODULES = {}      # id(nkisim module object) -> public module name
_API_BY_NAME = {}      # public module name -> module object
_API_CLASSES = {}      # API class -> its public_api.CLASSES key (matched exactly; NkiTensor also by subclass)
_PUBLIC_IDS = set()
_PUBLIC_FROM = [0]     # how many API modules _PUBLIC_IDS was built from


def register_api_module(mod, name):
    """``mod`` is nkisim's implementation of the public module ``name`` (``nki.language``, ...)."""
    _API_MODULES[id(mod)] = name
    _API_BY_NAME[name] = mod


def register_api_class(cls, key):
    """``cls`` is the API class documented as ``key`` (a public_api.CLASSES key, e.g. ``nki.language.NKIObject``)."""
    _API_CLASSES[cls] = key


def _api_class(key):
    for c, k in _API_CLASSES.items():
        if k == key:
            return c
    return None


def _api_module_name(mod):
    return _API_MODULES.get(id(mod))


_SUBMODULES = {"nki": ("language", "isa", "collectives", "typing"), "nki.isa": ("constants",)}


def _check_api_chain(api, mod, attrs, name, where):
    if api == "nki.typing":
        return
    a = attrs[0]
    if a in _SUBMODULES.get(api, ()):
        sub = getattr(mod, a, None)
        if sub is not None and len(attrs) > 1:
            _check_api_chain(_api_module_name(sub) or f"nki.{a}", sub, attrs[1:], f"{name}.{a}", where)
        return
    if f"{api}.{a}" in public_api.UNDOCUMENTED:
        return                   # provided with a fidelity warning when read (public_api.nki_package_getattr)
    if a not in public_api.MODULES.get(api, ()):
        _api_fail(f"{where} reads {name}.{a}: '{a}' is not part of {api} in the NKI 0.6 public interface "
                  f"(../shared/docs/nki-api-0.6.json)")
    if len(attrs) > 1:
        obj = getattr(mod, a, None)
        key = _api_class_key(obj)
        if key is not None and attrs[1] not in public_api.CLASSES.get(key, ()) and not _enum_member(obj, attrs[1]):
            _api_fail(f"{where} reads {name}.{a}.{attrs[1]}: '{attrs[1]}' is not a documented attribute of {key} "
                      f"(../shared/docs/nki-api-0.6.json)")


def _enum_member(obj, attr):
    return isinstance(obj, type) and issubclass(obj, enum.Enum) and attr in obj.__members__


def _public_ids():
    if _PUBLIC_FROM[0] != len(_API_BY_NAME):
        _PUBLIC_FROM[0] = len(_API_BY_NAME)
        pkg = _API_BY_NAME.get("nki")
        for n in ("nki.language", "nki.isa", "nki.collectives", "nki.isa.constants"):
            m = _API_BY_NAME.get(n)
            if m is None:
                continue
            for a in public_api.MODULES[n]:
                if hasattr(m, a):
                    _PUBLIC_IDS.add(id(getattr(m, a)))
        if pkg is not None:
            _PUBLIC_IDS.update((id(pkg.jit), id(pkg.simulate)))
        _PUBLIC_IDS.add(id(sys.modules[__package__ + ".jit"].Kernel))
    return _PUBLIC_IDS


def _api_class_key(obj):
    """The public_api.CLASSES key of an API object (or class), None if it is not one."""
    from .ops import Op
    from .registers import VirtualRegister
    from .tensor import NkiTensor
    cls = obj if isinstance(obj, type) else type(obj)
    if issubclass(cls, NkiTensor):
        return "nki.language.NkiTensor"
    if cls is VirtualRegister:
        return "nki.isa.VirtualRegister"
    key = _API_CLASSES.get(cls)
    if key is not None and key != "nki.language.NKIObject":
        return key
    if cls is Op:
        return "operator"          # nl.add, nl.exp, ...: documented as functions, no public attributes
    if issubclass(cls, enum.Enum) and cls.__module__.startswith("nkisim") and not isinstance(obj, type):
        return "enum member"
    return None


def _api_fail(msg):
    if API_RULE == "off":
        return
    text = f"nki.jit: undocumented API: {msg}. The API's public interface is ../shared/docs/nki-api-0.6.json " \
           f"(switch: nkisim.frontend.API_RULE)"
    if API_RULE == "error":
        raise NkiValidationError(text)
    if text not in _reported:
        _reported.add(text)
        warnings.warn(text, NkiFrontendWarning, stacklevel=4)


def attribute_guard(obj, name, public):
    """For API classes with a ``__getattribute__`` guard (ReplicaGroup): refuse ``name`` when kernel code reads it
    during a launch and it is not in ``public``."""
    if name in public or name.startswith("__"):
        return
    from .site import current_or_none
    if current_or_none() is None:
        return
    f = sys._getframe(2)
    fn = f.f_code.co_filename
    if _is_kernel_file(fn):
        key = _api_class_key(obj)
        _api_fail(f"{f.f_code.co_name} ({_short(fn, f.f_lineno)}) reads .{name} of a {type(obj).__name__}: not a "
                  f"documented attribute of {key}")


def _check_frame_attributes(code, frame, node):
    """Attribute reads ``x.attr`` in a function's own body whose ``x`` is, in the live ``frame``, an API object:
    ``attr`` must be public (types are known only at run time, so this needs the frame: done when the function is
    first seen on the stack at an ISA call)."""
    if code in _frame_checked or API_RULE == "off":
        return
    _frame_checked.add(code)
    # The receiver's type is read from the live frame once, so a variable bound more than once (it may hold another
    # type at the attribute's line, e.g. a tensor later wrapped in a helper object) is not judged by it.
    rebound = _rebound_names(node)
    sites = [n for n in _own_nodes(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
             and isinstance(n.value, ast.Name) and n.value.id not in rebound]
    if not sites:
        return
    # The classes of the variables, read once. frame.f_locals is a snapshot dict cached on the frame: it is emptied
    # right away so it does not keep the kernel's tiles alive (that would change later placements).
    local = frame.f_locals
    try:
        g = frame.f_globals
        kinds = {}
        for n in sites:
            var = n.value.id
            if var not in kinds:
                obj = local[var] if var in local else g.get(var)
                kinds[var] = None if obj is None or isinstance(obj, types.ModuleType) else \
                    (_api_class_key(obj), type(obj).__name__)
    finally:
        if code.co_flags & inspect.CO_OPTIMIZED:     # a function's snapshot (never a module / class namespace)
            local.clear()
        del local
    for n in sites:
        var = n.value.id
        k = kinds[var]
        if k is None or k[0] is None:
            continue
        pub = public_api.CLASSES.get(k[0], frozenset())
        if n.attr in pub or (n.attr.startswith("__") and n.attr.endswith("__")):
            continue
        _api_fail(f"{code.co_name} ({_short(code.co_filename, n.lineno)}) reads {var}.{n.attr}: '{n.attr}' is not a "
                  f"documented attribute of {k[0]} ('{var}' is a {k[1]})")


def _rebound_names(fnode):
    """Names bound more than once in a function's own body (a parameter counts as one binding)."""
    count = {}
    a = getattr(fnode, "args", None)
    if a is not None:
        for p in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x is not None]:
            count[p.arg] = 1
    for n in _own_nodes(fnode):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            count[n.id] = count.get(n.id, 0) + 1
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            count[n.target.id] = count.get(n.target.id, 0) + 1
    return {k for k, v in count.items() if v > 1}


def _own_nodes(fnode):
    """The nodes of a function body, not descending into nested functions / lambdas / classes."""
    todo = list(ast.iter_child_nodes(fnode))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(n))


# ---- dict keys (SDK-LG "NKI Values") ------------------------------------------------------------------------------
_SCAN_DEPTH = 2          # containers nested this deep are looked into
_SCAN_ITEMS = 32         # elements looked at per container
_NKIOBJECT = []          # [nl.NKIObject], once registered
_OBJ_TYPES = {}          # type -> whether its objects are user NKIObjects


def _bad_key(x, depth=0):
    """(path, key) of the first non-string dict key in ``x`` -- a dict, or dicts inside tuples / lists / NKIObjects,
    at most _SCAN_DEPTH deep and _SCAN_ITEMS elements per container -- or None."""
    t = type(x)
    if t is dict:
        for k in x:
            if type(k) is not str:
                return "", k
        items = [(f"[{k!r}]", v) for k, v in list(x.items())[:_SCAN_ITEMS]]
    elif t is tuple or t is list:
        items = [(f"[{i}]", v) for i, v in enumerate(x[:_SCAN_ITEMS])]
    elif _user_object(t):
        items = [(f".{k}", v) for k, v in list(vars(x).items())[:_SCAN_ITEMS]]
    else:
        return None
    if depth >= _SCAN_DEPTH:
        return None
    for p, v in items:
        tv = type(v)
        if tv is dict or tv is tuple or tv is list or _user_object(tv):
            bad = _bad_key(v, depth + 1)
            if bad is not None:
                return p + bad[0], bad[1]
    return None


def _user_object(t):
    """Whether objects of type ``t`` are user NKIObjects (their attributes are kernel values); cached per type."""
    r = _OBJ_TYPES.get(t)
    if r is None:
        if not _NKIOBJECT:
            base = _api_class("nki.language.NKIObject")
            if base is None:
                return False          # nki.language not imported yet: no NKIObjects exist
            _NKIOBJECT.append(base)
        r = _OBJ_TYPES[t] = issubclass(t, _NKIOBJECT[0]) and not t.__module__.startswith("nkisim") and \
            not hasattr(t, "__slots__")
    return r


def _dict_key_fail(msg):
    raise NkiValidationError(f"nki.jit: NKI Python subset: {msg}; {DICT_KEYS_DOC} (switch: nkisim.frontend.DICT_KEYS)")


def _check_frame_dicts(frame):
    """The local variables of a traced function (at an ISA call: dicts it was passed, built or got back from a
    helper) hold no dict with a non-string key. A dict built at run time (``d[k] = v``) is seen here, while the
    function is on the stack at an ISA call; the source lint sees only literal keys."""
    local = frame.f_locals
    try:
        bad = None
        for var, v in local.items():
            tv = type(v)
            if tv is dict or tv is tuple or tv is list or _user_object(tv):
                bad = _bad_key(v)
                if bad is not None:
                    bad = (var,) + bad
                    break
    finally:
        if frame.f_code.co_flags & inspect.CO_OPTIMIZED:   # see _check_frame_attributes: keep no tile alive
            local.clear()
        del local
    if bad is not None:
        c = frame.f_code
        _dict_key_fail(f"{c.co_name} ({_short(c.co_filename, frame.f_lineno)}): '{bad[0]}{bad[1]}' is a dict with the "
                       f"non-string key {bad[2]!r}")


def _global_dict_key(code, line, label, where, bad):
    """A module global / closure dict with a non-string key read by traced code: warned. The rule is documented, but
    AWS's nki-library (hardware-tested) reads such globals in the helpers its kernels run -- core/utils/
    kernel_helpers.py ``_act_fn_map`` (keys: ActFnType members), core/topk/rotational_topk.py
    ``SUPPORTED_TOPK_METHOD_MAPPING`` -- so the compiler evidently evaluates these lookups in Python."""
    key = (code.co_filename, line, "dictkey:" + label)
    if DICT_KEYS == "off" or key in _reported:
        return
    _reported.add(key)
    warnings.warn(f"nki.jit: NKI Python subset: {where}: '{label}{bad[0]}' is a dict with the non-string key "
                  f"{bad[1]!r}; {DICT_KEYS_DOC}. Warned, not refused, for module globals: AWS's hardware-tested "
                  f"nki-library reads such dicts in traced helpers (core/utils/kernel_helpers.py _act_fn_map, keyed "
                  f"by ActFnType members)", NkiFrontendWarning, stacklevel=5)


# ---- Python truth tests of registers (registers.py) ----------------------------------------------------------------
_TRUTH = {}      # (code, f_lasti) -> (while site or None, construct)


def truth_test(frame):
    """Where ``frame`` is truth-testing a value: ``((line, col), None)`` of the ``while`` statement when it is the
    condition of ``while <value>:`` and that condition is the value itself (a name, attribute or subscript), else
    ``(None, construct)`` naming what does the test ("an if statement", "not", ...). Found from the bytecode position
    of the instruction (``co_positions``: the jump of a while condition carries the statement's or the condition's
    span) matched against the function's source; cached per instruction."""
    code = frame.f_code
    key = (code, frame.f_lasti)
    r = _TRUTH.get(key)
    if r is None:
        r = _TRUTH[key] = _truth_test(code, frame.f_lasti)
    return r


def _span(n):
    return (n.lineno, n.end_lineno, n.col_offset, n.end_col_offset)


def _truth_test(code, lasti):
    positions = list(code.co_positions())
    i = lasti // 2
    pos = positions[i] if 0 <= i < len(positions) else None
    node = _node_of(code)
    if pos is None or None in pos or node is None:
        return None, "Python truth-testing"
    best = None
    for n in _own_nodes(node):
        if isinstance(n, ast.While) and pos in (_span(n), _span(n.test)):
            if isinstance(n.test, (ast.Name, ast.Attribute, ast.Subscript)):
                return (n.lineno, n.col_offset), None
            return None, f"the while condition '{ast.unparse(n.test)}' is not a single register value"
        if not hasattr(n, "end_lineno") or n.end_lineno is None:
            continue
        if (n.lineno, n.col_offset) <= (pos[0], pos[2]) and (n.end_lineno, n.end_col_offset) >= (pos[1], pos[3]):
            if best is None or (n.lineno, n.col_offset) >= (best.lineno, best.col_offset) and \
                    (n.end_lineno, n.end_col_offset) <= (best.end_lineno, best.end_col_offset):
                best = n
    return None, _construct(best)


def _construct(n):
    if isinstance(n, ast.If):
        return f"an if statement at line {n.lineno}"
    if isinstance(n, ast.IfExp):
        return f"a conditional expression at line {n.lineno}"
    if isinstance(n, ast.BoolOp):
        return f"'and' / 'or' at line {n.lineno}"
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
        return f"'not' at line {n.lineno}"
    if isinstance(n, ast.Assert):
        return f"an assert at line {n.lineno}"
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "bool":
        return f"bool() at line {n.lineno}"
    return "Python truth-testing" + ("" if n is None else f" at line {n.lineno}")


def while_body_exit(code, site):
    """A ``break`` / ``return`` that would leave the ``while`` statement at ``site`` (line, col) of ``code`` other
    than through its condition (described), or None. A ``break`` of a loop nested in the body is that loop's."""
    node = _node_of(code)
    if node is None:
        return None
    for w in _own_nodes(node):
        if isinstance(w, ast.While) and (w.lineno, w.col_offset) == site:
            todo = [(b, False) for b in w.body]
            while todo:
                n, nested = todo.pop()
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                    continue
                if isinstance(n, ast.Return):
                    return f"a return statement at line {n.lineno}"
                if isinstance(n, ast.Break) and not nested:
                    return f"a break statement at line {n.lineno}"
                if isinstance(n, (ast.For, ast.AsyncFor, ast.While)):     # its body's breaks are its own
                    todo.extend((c, True) for c in n.body)
                    todo.extend((c, nested) for c in n.orelse)
                else:
                    todo.extend((c, nested) for c in ast.iter_child_nodes(n))
    return None


# ---- classes (SDK-LG "Class Support") ------------------------------------------------------------------------------
def _user_class(cls):
    """A class defined in kernel code (not nkisim, the standard library or an installed package)."""
    if not isinstance(cls, type) or cls.__module__ in ("builtins",) or cls.__module__.startswith("nkisim"):
        return False
    mod = sys.modules.get(cls.__module__)
    fn = getattr(mod, "__file__", None) if mod is not None else None
    if fn is None:
        return cls.__module__ not in sys.builtin_module_names and not cls.__module__.startswith(("_", "numpy"))
    return _is_kernel_file(fn)


def class_rule(cls, where):
    """Refuse a user class that NKI cannot import (see the module docstring); cached per class."""
    if CLASS_RULE == "off":
        return
    if cls not in _classes:
        _classes[cls] = _class_problem(cls)
        if _classes[cls] is None:
            for k, v in vars(cls).items():          # its methods are traced code too
                f = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
                if isinstance(f, types.FunctionType) and _is_kernel_file(f.__code__.co_filename):
                    reach(f.__code__, f.__globals__, f"{cls.__name__}.{k}")
    problem = _classes[cls]
    if problem is None:
        return
    msg = (f"nki.jit: NKI classes: class {cls.__name__} ({_class_site(cls)}) reaches traced code ({where}): {problem} "
           f"(SDK nki-language-guide.rst 'Class Support'; switch: nkisim.frontend.CLASS_RULE)")
    if CLASS_RULE == "error":
        raise NkiValidationError(msg)
    if msg not in _reported:
        _reported.add(msg)
        warnings.warn(msg, NkiFrontendWarning, stacklevel=4)


def _class_site(cls):
    try:
        return _short(inspect.getsourcefile(cls), inspect.getsourcelines(cls)[1])
    except (TypeError, OSError):
        return cls.__module__


def _class_problem(cls):
    NKIObject = _api_class("nki.language.NKIObject")
    if issubclass(cls, enum.Enum):
        if cls.__bases__ != (enum.Enum,):
            return (f"an enumeration must derive from Enum alone ('class E(Enum)', section 'Enumerations'), it derives "
                    f"from {', '.join(b.__name__ for b in cls.__bases__)}")
        return None
    chain = [c for c in cls.__mro__ if c not in (object, NKIObject)]
    if NKIObject not in cls.__mro__:
        return (f"it must inherit from nl.NKIObject and no other class ('the class must inherit from NKIObject and no "
                f"other classes'); its bases are ({', '.join(b.__name__ for b in cls.__bases__) or 'object'})")
    for c in chain:
        if len(c.__bases__) != 1 or not _user_class(c):
            return (f"it must inherit from nl.NKIObject and no other class ('the class must inherit from NKIObject and "
                    f"no other classes'); {c.__name__} derives from ({', '.join(b.__name__ for b in c.__bases__)})")
    for c in chain:
        if "__slots__" in vars(c):
            return (f"{c.__name__} declares __slots__; only the object dictionary crosses into NKI ('NKI does not look "
                    f"at slots or other object features, only the object dictionary'): drop __slots__")
        for k, v in vars(c).items():
            if isinstance(v, property) or (hasattr(type(v), "__get__") and hasattr(type(v), "__set__")
                                           and not isinstance(v, (types.FunctionType, staticmethod, classmethod))):
                return (f"{c.__name__}.{k} is a {type(v).__name__}; only the object dictionary crosses into NKI ('NKI "
                        f"does not look at slots or other object features, only the object dictionary'): store the "
                        f"value as a plain attribute (set it in __init__ / __post_init__) or make it a method")
    # (a frozen @dataclass is accepted: the guide says nothing of it and AWS's nki-library passes frozen NKIObject
    # dataclasses to its kernels, e.g. core/topk/rotational_topk_utils.py TopkHardwareParams)
    return None


# ---- the kernel frames at ISA calls ----------------------------------------------------------------------------
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
                    reach(code, f.f_globals, f"{code.co_name} (on the stack)")
                    node = _node_of(code)
                    if node is not None:
                        _check_frame_attributes(code, f, node)
                except NkiValidationError:
                    del st[code]     # refused: refuse it again at the next launch too
                    _reached.discard(code)
                    _frame_checked.discard(code)
                    raise
        if s:
            return
        if DICT_KEYS == "error":
            _check_frame_dicts(f)
        b = f.f_back
        bc = None if b is None else b.f_code
        rec = seen.get(id(f))
        if rec is not None and rec[0] is code and rec[1] == id(b) and rec[2] is bc:
            return
        seen[id(f)] = (code, id(b), bc)
        f = b


# ---- source lint -------------------------------------------------------------------------------------------------
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


def _node_of(code):
    tree = _module_tree(code.co_filename)
    return None if tree is None else _function_node(tree, code)


def _lint_code(code, is_kernel=False):
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
        lint_node(node, code.co_name, code.co_filename, 0, helper=not is_kernel)


_WARN = ((ast.ListComp, "a list comprehension"), (ast.SetComp, "a set comprehension"),
         (ast.DictComp, "a dict comprehension"), (ast.GeneratorExp, "a generator expression"),
         (ast.Lambda, "a lambda"), (ast.Yield, "a generator function (yield)"),
         (ast.YieldFrom, "a generator function (yield from)"))
_SUBSET = ("the NKI <= 0.6 front end specialises a subset of Python and may reject it (write an explicit loop / a "
           "named def; see nkisim.frontend)")
_TRY = getattr(ast, "TryStar", ast.Try)


def _loop_bodies(tree):
    """Names passed as the body of nl.fori_loop (3rd argument / body_fun=) or nl.while_loop (2nd / body_fun=)."""
    out = set()
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        pos = {"fori_loop": 2, "while_loop": 1}.get(fname)
        if pos is None:
            continue
        cand = [n.args[pos]] if len(n.args) > pos else []
        cand += [k.value for k in n.keywords if k.arg == "body_fun"]
        out.update(c.id for c in cand if isinstance(c, ast.Name))
    return out


def lint_node(tree, fname, filename, line_offset, helper):
    """Errors / warnings for one function's AST (``line_offset`` maps tree lines to file lines)."""
    where = os.path.basename(filename)
    kind = "helper" if helper else "kernel"
    bodies = None
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0) + line_offset
        if isinstance(node, ast.Compare):
            for o in node.ops:
                if isinstance(o, (ast.Is, ast.IsNot)):
                    word = "is not" if isinstance(o, ast.IsNot) else "is"
                    if helper and not HELPER_ERRORS:
                        _warn_once(filename, line, f"'{word}'", kind, fname, where,
                                   "NKI 0.3.0 'Language restrictions' says the compiler does not support 'is'/'is "
                                   "not' (AWS's nki-library uses 'is None' in helpers it compiles, hence a warning "
                                   "here; an error in the kernel body): use == / !=")
                        continue
                    raise NkiValidationError(
                        f"nki.jit: NKI Python subset: {kind} {fname} uses '{word}' at {where}:{line}; the NKI compiler rejects 'is'/'is "
                        f"not' (NKI 0.3.0 update guide, Language Restrictions; the front end processes every function "
                        f"the kernel calls): use == / != instead (e.g. 'x == None')")
        elif isinstance(node, ast.Dict):
            for k in node.keys:
                if isinstance(k, ast.Constant) and not isinstance(k.value, str):
                    raise NkiValidationError(
                        f"nki.jit: NKI Python subset: {kind} {fname} builds a dict with key {k.value!r} at {where}:{line}; "
                        f"{DICT_KEYS_DOC}")
        if node is tree:
            if helper and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                if a.vararg or a.kwarg or a.kwonlyargs:
                    _warn_once(filename, line, "a '*' / '**' parameter", kind, fname, where,
                               "NKI 0.3.0 refuses '*' in kernel signatures (update guide 'Language restrictions'); "
                               "helpers are not named there, keep them to plain parameters")
            continue
        if hw.KLR_FORMS != "off":
            form = klr_form(node)
            if form is not None:
                _klr_report(filename, line, form, kind, fname, where)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if bodies is None:
                bodies = _loop_bodies(tree)
            if node.name not in bodies:
                _warn_once(filename, line, f"an inner def ({node.name})", kind, fname, where,
                           "trn2-costs.md reports inner defs rejected by the NKI front end; only a def passed as the "
                           "body of nl.fori_loop / nl.while_loop is the documented 0.6 form: make it a module-level "
                           "function")
            continue
        if isinstance(node, (ast.Try, _TRY)):
            _warn_once(filename, line, "a try statement", kind, fname, where,
                       "exception handling is not among the constructs the NKI language guide documents; " + _SUBSET)
            continue
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            _warn_once(filename, line, f"a '{'global' if isinstance(node, ast.Global) else 'nonlocal'}' statement",
                       kind, fname, where, "writing state outside the kernel breaks purity (SDK-LG 'Kernel Caching': "
                       "kernels must be pure functions of their arguments)")
            continue
        for cls, what in _WARN:
            if isinstance(node, cls):
                _warn_once(filename, line, what, kind, fname, where, _SUBSET)
                break


_KLR = "leanprover/KLR KLR/NKI/Simplify.lean"


def klr_form(node):
    """(what, evidence) if ``node`` is a Python form the KLR front end refuses (nkisim.hw.KLR_FORMS), else None."""
    if isinstance(node, (ast.For, ast.AsyncFor)):
        if not isinstance(node.target, ast.Name):
            return (f"the for-loop target '{_src(node.target)}' (not a single name)",
                    f"{_KLR}:372 (forLoop: simpleVar, 'expecting simple variable'): write 'for i in range(len(xs)):' "
                    f"and unpack 'a, b = xs[i]' in the body")
        if node.orelse:
            return "a for ... else", f"{_KLR}:370 ('for-orelse is not supported in NKI')"
    elif isinstance(node, ast.While):
        if node.orelse:
            return "a while ... else", f"{_KLR}:380 ('while-orelse is not supported in NKI')"
    elif isinstance(node, ast.Assign):
        for t in node.targets:
            if isinstance(t, ast.List) or (isinstance(t, ast.Tuple) and not _plain_names(t)):
                return (f"the assignment target '{_src(t)}' (a tuple / list target holding more than plain "
                        f"names)", f"{_KLR}:299-316 (pattern: a tuple target holds plain names only, 'expecting "
                        f"simple variable' / 'expecting pattern'): one assignment per attribute / subscript")
        sets = [t for t in node.targets if not isinstance(t, (ast.Name, ast.Tuple))]
        if len(sets) > 1:
            return (f"the chained assignment '{' = '.join(_src(t) for t in node.targets)} = ...' (more than "
                    f"one attribute / subscript target)", f"{_KLR}:310-316 (letSet: 'mutating assignments must be in "
                    f"separate statements')")
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        items = node.items
        if (len(items) != 1 or items[0].optional_vars is not None or not isinstance(items[0].context_expr, ast.Call)
                or items[0].context_expr.args or items[0].context_expr.keywords):
            return (f"the with statement 'with {', '.join(ast.unparse(i) for i in items)}' (not one argument-less call "
                    f"without 'as')", f"{_KLR}:382-393 ('NKI only supports with statements with a single, simple "
                    f"function call as context', 'NKI does not support name bindings in with statements')")
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("enumerate", "zip"):
        return (f"{node.func.id}()", "leanprover/KLR KLR/Trace/Python.lean:79-388 (the Python builtins KLR defines: "
                "abs bool dict divmod float int isinstance len list max min print slice str tuple type; no "
                "enumerate / zip, so the name is 'not found', KLR/Trace/NKI.lean:86-98): iterate 'for i in "
                "range(len(xs)):' and index")
    return None


def _src(t):
    """A target's source, a top-level tuple without its parentheses (as written: ``a, b``)."""
    return ", ".join(ast.unparse(e) for e in t.elts) if isinstance(t, ast.Tuple) else ast.unparse(t)


def _plain_names(t):
    return all(isinstance(e, ast.Name) or (isinstance(e, ast.Tuple) and _plain_names(e)) for e in t.elts)


def _klr_report(filename, line, form, kind, fname, where):
    what, why = form
    msg = (f"nki.jit: NKI Python subset: {kind} {fname} uses {what} at {where}:{line}; the NKI 0.6 front end "
           f"probably rejects it: {why}; AWS's hardware-tested nki-library kernels never use it (switch: "
           f"nkisim.hw.KLR_FORMS)")
    if hw.KLR_FORMS == "error":
        raise NkiValidationError(msg)
    if hw.KLR_FORMS != "warn":
        raise ValueError(f"nkisim.hw.KLR_FORMS = {hw.KLR_FORMS!r}: expected 'error', 'warn' or 'off'")
    key = (filename, line, "klr:" + what)
    if key not in _reported:
        _reported.add(key)
        warnings.warn(msg, NkiFrontendWarning, stacklevel=4)


def _warn_once(filename, line, what, kind, fname, where, why):
    key = (filename, line, what)
    if key not in _reported:
        _reported.add(key)
        warnings.warn(f"nki.jit: NKI Python subset: {kind} {fname} uses {what} at {where}:{line}; {why}", NkiFrontendWarning, stacklevel=3)
