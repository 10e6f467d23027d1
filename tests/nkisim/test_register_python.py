"""Python on register values (nkisim/registers.py): refused, except ``reg == None`` and the documented (deprecated)
``while reg:`` runtime loop, which runs as a runtime loop (traced, LNC-checked) like nl.while_loop.

Sources: SDK-ISA VirtualRegister note ("using a register in Python control flow (if/while) or converting it with
int() / range() raises TypeError" under the tracer); nki-language-guide.rst "Dynamic Control Flow" ("A dynamic while
loop is specified using the standard while-loop with a condition that is a single register value");
SDK-RN 0.6.0 "Deprecated and Removed APIs" (``while reg:`` deprecated, warned)."""
import re
import warnings

import numpy as np
import pytest

import nki
import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl
import nkisim
from nki.collectives import ReplicaGroup

HERE = "test_register_python.py"
F32 = np.float32


def _line(fn, text):
    import inspect
    lines, first = inspect.getsourcelines(fn)
    for i, ln in enumerate(lines):
        if text in ln:
            return f"{HERE}:{first + i}"
    raise AssertionError(f"{text!r} not in {fn.__name__}")


def _refused(match, fn, *args, exc=nkisim.NkiValidationError):
    with pytest.raises(exc) as e:
        fn(*args)
    assert re.search(match, str(e.value), re.S), str(e.value)
    return e.value


def _counter(n_sb):
    """A register loaded with the count in n_sb."""
    reg = nisa.register_alloc()
    nisa.register_load(reg, n_sb)
    return reg


def _setup(n):
    n_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=n_sb, src=n)
    acc = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    return n_sb, acc


def _finish(acc):
    out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=acc)
    return out


@nki.jit
def while_reg(n):
    """acc = number of iterations = n (the documented dynamic while pattern)."""
    n_sb, acc = _setup(n)
    reg = _counter(n_sb)
    while reg:
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
        nisa.tensor_scalar(dst=n_sb, data=n_sb, op0=nl.subtract, operand0=1)
        nisa.register_load(reg, n_sb)
    return _finish(acc)


@nki.jit
def while_loop_twin(n):
    """The same loop written with nl.while_loop (the 0.6.0 replacement)."""
    n_sb, acc = _setup(n)
    reg = _counter(n_sb)

    def body(r):
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
        nisa.tensor_scalar(dst=n_sb, data=n_sb, op0=nl.subtract, operand0=1)
        nisa.register_load(r, n_sb)
        return r
    nl.while_loop(reg, body)
    return _finish(acc)


def test_while_reg_is_a_runtime_loop():
    with pytest.warns(DeprecationWarning, match=r"'while reg:' loops are deprecated since NKI 0.6.0"):
        with nkisim.trace.capture() as tr:
            out = while_reg(np.array([[5]], np.int32))
    np.testing.assert_array_equal(out, [[5.0]])
    loops = tr.loops
    assert [(lp["op"], lp["trips"]) for lp in loops] == [("while reg", 5)]
    assert loops[0]["loc"] == _line(while_reg.fn, "while reg:")
    body = [r for r in tr.instructions if r.get("loop")]
    assert len(body) == 15                                    # 3 instructions x 5 iterations
    assert [r["loop"][0][1] for r in body[::3]] == [0, 1, 2, 3, 4]
    cond = {r["reg_writes"][0] for r in tr.instructions if r["op"] == "register_load"}
    assert all(set(r["reg_reads"]) & cond for r in body)      # the body reads the condition register

    with nkisim.trace.capture() as tw:
        twin = while_loop_twin(np.array([[5]], np.int32))
    np.testing.assert_array_equal(twin, out)
    assert [lp["trips"] for lp in tw.loops] == [5]
    assert len([r for r in tw.instructions if r.get("loop")]) == 15


def test_while_reg_zero_trips_and_shape_only():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        np.testing.assert_array_equal(while_reg(np.array([[0]], np.int32)), [[0.0]])
        with nkisim.trace.capture() as tr:
            while_reg(np.array([[0]], np.int32))
        assert [lp["trips"] for lp in tr.loops] == [0]
        with nkisim.shape_only(), nkisim.trace.capture() as so:
            while_reg(nkisim.ShapeDtype((1, 1), "int32"))
    assert [(lp["op"], lp["trips"]) for lp in so.loops] == [("while reg", 0)]   # placeholder register: 0


@nki.jit
def per_core_while(n):
    """Each core counts down from its own row of n: legal only if both rows are equal (LNC-uniform)."""
    pid = nl.program_id(0)
    n_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=n_sb, src=n[pid:pid + 1, :])
    acc = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    reg = nisa.register_alloc()
    nisa.register_load(reg, n_sb)
    while reg:
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
        nisa.tensor_scalar(dst=n_sb, data=n_sb, op0=nl.subtract, operand0=1)
        nisa.register_load(reg, n_sb)
    out = nl.ndarray((2, 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[pid:pid + 1, :], src=acc)
    return out


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_while_reg_lnc_uniformity():
    np.testing.assert_array_equal(per_core_while[2](np.array([[3], [3]], np.int32)), [[3.0], [3.0]])
    site = _line(per_core_while.fn, "while reg:")
    msg = str(_refused(r"LNC-uniform control flow: the cores of an LNC=2 kernel ran different runtime loops",
                       per_core_while[2], np.array([[3], [2]], np.int32)))
    assert f"core 0: while reg at {site} (depth 0, 3 trips)" in msg
    assert f"core 1: while reg at {site} (depth 0, 2 trips)" in msg


@nki.jit
def while_in_no_reorder(n):
    n_sb, acc = _setup(n)
    reg = _counter(n_sb)
    with nl.no_reorder():
        while reg:
            nisa.register_move(reg, 0)
    return _finish(acc)


@nki.jit
def while_with_break(n):
    n_sb, acc = _setup(n)
    reg = _counter(n_sb)
    while reg:
        nisa.register_move(reg, 0)
        break
    return _finish(acc)


@nki.jit
def while_with_inner_break(n):
    """A break of a Python loop nested in the body is that loop's: legal."""
    n_sb, acc = _setup(n)
    reg = _counter(n_sb)
    while reg:
        for k in range(3):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
            if k == 1:
                break
        nisa.register_move(reg, 0)
    return _finish(acc)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_while_reg_loop_rules():
    n = np.array([[2]], np.int32)
    _refused(rf"runtime loops: while reg at {_line(while_in_no_reorder.fn, 'while reg:')}: runtime loops are not "
             rf"supported inside an nl.no_reorder\(\) block", while_in_no_reorder, n)
    _refused(rf"runtime loops: while_with_break \({HERE}:\d+\): the 'while reg:' loop at line "
             rf"{_line(while_with_break.fn, 'while reg:').split(':')[1]} has a break statement at line "
             rf"{_line(while_with_break.fn, '        break').split(':')[1]}", while_with_break, n)
    np.testing.assert_array_equal(while_with_inner_break(n), [[2.0]])


# ---- refused: Python computing with, comparing or branching on a register -----------------------------------------
@nki.jit
def if_reg(x):
    reg = nisa.register_alloc(1)
    if reg:
        nisa.register_move(reg, 0)
    return x


@nki.jit
def ifexp_reg(x):
    reg = nisa.register_alloc(1)
    v = 1 if reg else 0
    return x if v else x


@nki.jit
def bool_reg(x):
    reg = nisa.register_alloc(1)
    flag = bool(reg)
    return x if flag else x


@nki.jit
def not_reg(x):
    reg = nisa.register_alloc(1)
    flag = not reg
    return x if flag else x


@nki.jit
def while_not_reg(x):
    reg = nisa.register_alloc(0)
    while not reg:
        nisa.register_move(reg, 1)
    return x


@nki.jit
def while_reg_and(x):
    reg = nisa.register_alloc(1)
    flag = True
    while reg and flag:
        flag = False
    return x


@nki.jit
def eq_reg(x):
    reg = nisa.register_alloc(1)
    if reg == 1:
        nisa.register_move(reg, 0)
    return x


@nki.jit
def ne_regs(x):
    a = nisa.register_alloc(1)
    b = nisa.register_alloc(1)
    if a != b:
        nisa.register_move(a, 0)
    return x


@nki.jit
def add_reg(x):
    reg = nisa.register_alloc(1)
    nisa.register_move(reg, reg + 1)
    return x


@nki.jit
def lt_reg(x):
    reg = nisa.register_alloc(1)
    if reg < 3:
        nisa.register_move(reg, 0)
    return x


@nki.jit
def range_reg(x):
    reg = nisa.register_alloc(2)
    for _ in range(reg):
        nisa.register_move(reg, 0)
    return x


@pytest.mark.parametrize("kernel, line_text, what", [
    (if_reg, "if reg:", r"uses it as a Python truth value \(an if statement at line \d+\)"),
    (ifexp_reg, "1 if reg else 0", r"uses it as a Python truth value \(a conditional expression at line \d+\)"),
    (bool_reg, "bool(reg)", r"uses it as a Python truth value \(bool\(\) at line \d+\)"),
    (not_reg, "not reg", r"uses it as a Python truth value \('not' at line \d+\)"),
    (while_not_reg, "while not reg", r"uses it as a Python truth value \(the while condition 'not reg' is not a single register value\)"),
    (while_reg_and, "while reg and", r"uses it as a Python truth value \(the while condition 'reg and flag' is not a single register value\)"),
    (eq_reg, "reg == 1", r"compares it with =="),
    (ne_regs, "a != b", r"compares it with !="),
    (add_reg, "reg + 1", r"computes with it \(Python arithmetic\)"),
    (lt_reg, "reg < 3", r"compares it with < / <= / > / >="),
    (range_reg, "range(reg)", r"converts it to a Python number \(int\(\) / float\(\) / range\(\) / an index\)"),
])
def test_python_on_registers_is_refused(kernel, line_text, what):
    e = _refused(rf"NKI registers: {kernel.fn.__name__} \({_line(kernel.fn, line_text)}\) {what} on a "
                 rf"VirtualRegister: a register holds a run-time value.*SDK-ISA VirtualRegister",
                 kernel, np.zeros((1, 1), F32))
    assert isinstance(e, TypeError)          # the SDK documents a TypeError


@nki.jit
def none_tests(x):
    """Legal twin: comparing a register with None is a static test of the Python value."""
    reg = nisa.register_alloc(1)
    t = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=2.0 if (reg != None and not (reg == None)) else -1.0)
    out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_register_compared_with_none_is_legal():
    np.testing.assert_array_equal(none_tests(np.zeros((1, 1), F32)), [[2.0]])


@nki.jit
def rank_branch(x, rg):
    """Branches on the rank register: rank_id() returns a register (its value exists at run time only)."""
    t = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=0.0)
    if ncc.rank_id() == 1:
        nisa.memset(dst=t, value=1.0)
    out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def rank_select(x, rg):
    """Legal twin: the rank register as a dynamic offset (each rank reads its own row of x)."""
    t = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.ap(pattern=[[1, 1], [1, 1]], offset=0, scalar_offset=ncc.rank_id(), indirect_dim=0))
    out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_rank_id_comparison_refused_and_register_offset_twin():
    x = np.arange(2, dtype=F32).reshape(2, 1) + 10
    rg = ReplicaGroup([[0, 1]])
    _refused(rf"NKI registers: rank_branch \({_line(rank_branch.fn, 'ncc.rank_id() == 1')}\) compares it with ==",
             nkisim.launch, rank_branch, [(x, rg), (x, rg)], 2, 1)
    outs = nkisim.launch(rank_select, [(x, rg), (x, rg)], tp=2, lnc=1)
    np.testing.assert_array_equal([o[0, 0] for o in outs], [10.0, 11.0])
