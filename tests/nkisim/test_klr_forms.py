"""Python forms the NKI 0.6 front end (KLR) refuses, linted in every traced function (nkisim.hw.KLR_FORMS): a for-loop
target that is not a single name, a tuple target holding an attribute / subscript, a chained assignment with more
than one attribute / subscript target, enumerate / zip, for / while ... else, a with statement other than one
argument-less call. Each is warned once per site with its file:line and the KLR citation; the legal rewrites are not."""
import warnings

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim import frontend, hw
from nkisim.frontend import NkiFrontendWarning

F32 = np.float32


class _Pair(nl.NKIObject):
    def __init__(self):
        self.a = 0.0
        self.b = 0.0

    def set_both(self, a, b):
        self.a, self.b = a, b                          # tuple target with attributes

    def clear(self):
        self.a = self.b = 0.0                          # chained: two attribute targets


class _LegalPair(nl.NKIObject):
    """(Every method of a class reaching traced code is linted, so the legal forms live in their own class.)"""
    def __init__(self):
        self.a = 0.0
        self.b = 0.0

    def set_legal(self, a, b):
        self.a = a                                     # one assignment per attribute
        self.b = b
        x = y = a                                      # chained to plain names: fine
        return x + y


def _helper_forms(t, pairs):
    """Every refused form once; writes column c of t with a value the forms compute."""
    for c, (v, w) in enumerate(pairs):                 # tuple target + enumerate
        nisa.memset(dst=t[:, c:c + 1], value=v + w)
    for v, w in zip((1.0,), (2.0,)):                   # tuple target + zip
        nisa.memset(dst=t[:, 2:3], value=v * w)
    cols = [0.0, 0.0]
    cols[0], cols[1] = 3.0, 4.0                        # tuple target with subscripts
    nisa.memset(dst=t[:, 3:4], value=cols[0] + cols[1])
    for c in range(1):
        pass
    else:                                              # for ... else
        pass
    p = _Pair()
    p.set_both(1.0, 2.0)
    p.clear()


def _helper_legal(t, pairs):
    """The same values in the forms KLR accepts."""
    for c in range(len(pairs)):
        v, w = pairs[c]                                # plain-name tuple target
        nisa.memset(dst=t[:, c:c + 1], value=v + w)
    xs = (1.0,)
    ys = (2.0,)
    for i in range(len(xs)):
        nisa.memset(dst=t[:, 2:3], value=xs[i] * ys[i])
    cols = [0.0, 0.0]
    cols[0] = 3.0
    cols[1] = 4.0
    a, (b, d) = cols[0], (cols[1], 0.0)               # nested tuple of plain names
    nisa.memset(dst=t[:, 3:4], value=a + b + d)
    p = _LegalPair()
    p.set_legal(1.0, 2.0)
    with nl.no_reorder():                              # one argument-less call: fine
        pass


def _kernel(helper):
    @nki.jit
    def k(x):
        t = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf)
        helper(t, ((1.0, 1.0), (2.0, 0.0)))
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k


def _klr_messages(rec):
    return [str(w.message) for w in rec if issubclass(w.category, NkiFrontendWarning)
            and "nkisim.hw.KLR_FORMS" in str(w.message)]


def _line(fn, text):
    import inspect
    src, first = inspect.getsourcelines(fn)
    return first + next(i for i, s in enumerate(src) if text in s)


@pytest.fixture
def _relint():
    """Lint the test helpers afresh (the lint caches code objects and sites)."""
    def clear():
        frontend._reached.clear()
        frontend._state.clear()
        frontend._classes.clear()
        frontend._reported.clear()
    clear()
    old = hw.KLR_FORMS
    yield
    hw.KLR_FORMS = old
    clear()


EXPECTED = [[2.0, 2.0, 2.0, 7.0]] * 2


def test_each_form_is_warned_once_with_site_and_citation(_relint):
    k = _kernel(_helper_forms)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = k(np.zeros((1, 1), F32))
        k(np.zeros((1, 1), F32))                       # a second launch: no new warnings
    np.testing.assert_array_equal(out, EXPECTED)
    msgs = _klr_messages(rec)
    f = "test_klr_forms.py"
    want = [
        (_line(_helper_forms, "enumerate(pairs)"), "the for-loop target 'c, (v, w)' (not a single name)",
         "Simplify.lean:372"),
        (_line(_helper_forms, "enumerate(pairs)"), "enumerate()", "Trace/Python.lean:79-388"),
        (_line(_helper_forms, "zip((1.0,)"), "the for-loop target 'v, w'", "Simplify.lean:372"),
        (_line(_helper_forms, "zip((1.0,)"), "zip()", "Trace/Python.lean:79-388"),
        (_line(_helper_forms, "cols[0], cols[1] ="), "the assignment target 'cols[0], cols[1]'",
         "Simplify.lean:299-316"),
        (_line(_helper_forms, "for c in range(1):"), "a for ... else", "Simplify.lean:370"),
        (_line(_Pair.set_both, "self.a, self.b ="), "the assignment target 'self.a, self.b'",
         "Simplify.lean:299-316"),
        (_line(_Pair.clear, "self.a = self.b ="), "the chained assignment 'self.a = self.b = ...'",
         "Simplify.lean:310-316"),
    ]
    for line, what, cite in want:
        hits = [m for m in msgs if f"uses {what}" in m and f"at {f}:{line};" in m]
        assert len(hits) == 1, (what, line, msgs)
        assert cite in hits[0] and "leanprover/KLR" in hits[0]
    assert len(msgs) == len(want), msgs


def test_legal_rewrites_are_not_warned(_relint):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = _kernel(_helper_legal)(np.zeros((1, 1), F32))
    np.testing.assert_array_equal(out, EXPECTED)
    assert _klr_messages(rec) == []


def test_switch_error_refuses_and_off_is_silent(_relint):
    hw.KLR_FORMS = "error"
    with pytest.raises(nkisim.NkiValidationError, match=r"NKI Python subset: .* uses .* at test_klr_forms.py:\d+; "
                                                         r"the NKI 0.6 front end probably rejects it"):
        _kernel(_helper_forms)(np.zeros((1, 1), F32))
    hw.KLR_FORMS = "off"
    frontend._reached.clear()
    frontend._state.clear()
    frontend._classes.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = _kernel(_helper_forms)(np.zeros((1, 1), F32))
    np.testing.assert_array_equal(out, EXPECTED)
    assert _klr_messages(rec) == []


@pytest.mark.parametrize("src, what", [
    ("with a() as b:\n    pass", "the with statement 'with a() as b'"),
    ("with a(1):\n    pass", "the with statement 'with a(1)'"),
    ("while x:\n    pass\nelse:\n    pass", "a while ... else"),
    ("[a, b] = c", "the assignment target '[a, b]'"),
    ("a, *b = c", "the assignment target 'a, *b'"),
    ("x[0] = y.a = 1", "the chained assignment 'x[0] = y.a = ...'"),
])
def test_klr_form_classifies_the_other_forms(src, what):
    import ast
    forms = [frontend.klr_form(n) for n in ast.walk(ast.parse(src))]
    forms = [f for f in forms if f is not None]
    assert len(forms) == 1 and forms[0][0].startswith(what), forms
    for legal in ("a = b.c = 1", "a, (b, c) = d", "for i in range(3):\n    pass", "with nl.no_reorder():\n    pass",
                  "x.a += 1", "x[0] = 1"):
        assert all(frontend.klr_form(n) is None for n in ast.walk(ast.parse(legal))), legal
