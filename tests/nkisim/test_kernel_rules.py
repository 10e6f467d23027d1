"""The documented rule classes of issue 12, each with its negative tests (the message names the rule and the kernel
line) and a legal twin that runs and matches numpy: LNC-uniform runtime control flow, 32-bit integers, NKIObject
classes and kernel purity, runtime-loop rules (no_reorder, steps, PSUM loop state), the NKI Python subset in every
traced function and the public API surface. Sources: nkisim/README.md "Rules enforced"."""
import enum
import re
import warnings
from dataclasses import dataclass

import numpy as np
import pytest

import nki
import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim import hw
from nkisim.errors import NkiFidelityWarning
from nkisim.frontend import NkiFrontendWarning

F32 = np.float32
I32 = np.int32
HERE = "test_kernel_rules.py"


def _line(fn, text):
    """file:line of the first source line of ``fn`` that contains ``text`` (so messages can be checked exactly)."""
    import inspect
    lines, first = inspect.getsourcelines(fn)
    for i, ln in enumerate(lines):
        if text in ln:
            return f"{HERE}:{first + i}"
    raise AssertionError(f"{text!r} not in {fn.__name__}")


def _refused(match, fn, *args, **kw):
    with pytest.raises(nkisim.NkiValidationError) as e:
        fn(*args, **kw)
    assert re.search(match, str(e.value), re.S), str(e.value)
    return str(e.value)


# =====================================================================================================================
# 1. LNC-uniform runtime control flow (SDK lnc.rst "Final Notes")
# =====================================================================================================================
def _load_reg(n):
    """A register holding the int32 [1, 1] HBM value ``n``."""
    t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=n)
    r = nisa.register_alloc()
    nisa.register_load(r, t)
    return r


def _count_loop(n):
    """LNC=2: both cores add 1.0 per iteration of a runtime loop whose trip count core c reads from n[c]."""
    @nki.jit
    def k(x, n):
        pid = nl.program_id(0)
        acc = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=acc, src=x)
        r = _load_reg(n[pid:pid + 1, :])

        def body(i):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
        nl.fori_loop(0, r, body)
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=acc)
        return out
    return k


def test_lnc_trip_count_differs_by_core():
    k = _count_loop(None)
    site = _line(k.fn, "nl.fori_loop(0, r, body)")
    msg = _refused(r"LNC-uniform control flow: .*ran different runtime loops \(first difference at runtime loop #0\)",
                   k[2], np.zeros((1, 4), F32), np.array([[3], [2]], I32))
    assert f"core 0: fori_loop at {site} (depth 0, 3 trips)" in msg
    assert f"core 1: fori_loop at {site} (depth 0, 2 trips)" in msg
    assert "lnc.rst 'Final Notes'" in msg


def test_lnc_uniform_trip_counts_legal_twin():
    out = _count_loop(None)[2](np.ones((1, 4), F32), np.array([[3], [3]], I32))
    np.testing.assert_array_equal(out, np.full((2, 4), 4.0, F32))


def test_lnc_loop_on_one_core_only_and_static_difference_is_fine():
    @nki.jit
    def k(x, n):
        pid = nl.program_id(0)
        acc = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=acc, src=x)
        for _ in range(pid + 1):                    # static (Python) difference between the cores: legal
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.multiply, operand0=2.0)
        r = _load_reg(n)

        def body(i):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
        if pid == 0 or ONE_CORE[0] == 0:
            nl.fori_loop(0, r, body)
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=acc)
        return out
    x, n = np.ones((1, 4), F32), np.array([[2]], I32)
    ONE_CORE[0] = 0
    out = k[2](x, n)
    np.testing.assert_array_equal(out, [[4.0] * 4, [6.0] * 4])   # 1*2+2 and 1*4+2
    ONE_CORE[0] = 1
    msg = _refused(r"LNC-uniform control flow: .*first difference at runtime loop #0", k[2], x, n)
    assert "core 1: no runtime loop; its runtime loops (0 in all)" in msg and "depth 0, 2 trips" in msg


ONE_CORE = [0]     # mutable switch read by the kernel above (a purity warning, on purpose)


def test_lnc_while_loop_iterations_differ():
    @nki.jit
    def k(x, n):
        pid = nl.program_id(0)
        cnt = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=cnt, src=n[pid:pid + 1, :])
        one = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=one, value=1)
        acc = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=acc, src=x)
        r = nisa.register_alloc()
        nisa.register_load(r, cnt)

        def body(c):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
            nisa.tensor_tensor(dst=cnt, data1=cnt, data2=one, op=nl.subtract)
            nisa.register_load(c, cnt)
            return c
        nl.while_loop(r, body)
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=acc)
        return out
    site = _line(k.fn, "nl.while_loop(r, body)")
    msg = _refused("LNC-uniform control flow", k[2], np.zeros((1, 4), F32), np.array([[2], [5]], I32))
    assert f"while_loop at {site} (depth 0, 2 trips)" in msg and f"while_loop at {site} (depth 0, 5 trips)" in msg
    np.testing.assert_array_equal(k[2](np.zeros((1, 4), F32), np.array([[3], [3]], I32)), np.full((2, 4), 3.0))


def test_lnc_nesting_differs_in_shape_only_multi_rank_launch():
    """Shape-only, nkisim.launch(tp=2, lnc=2), register values from the provider: on rank 1 core 1 the loop runs
    at depth 1 inside an outer runtime loop, elsewhere at depth 0; refused at core 1's first differing loop."""
    @nki.jit
    def k(x, n, rank):
        pid = nl.program_id(0)
        acc = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=acc, src=x)
        r = _load_reg(n)

        def inner(i):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)

        def outer(j):
            nl.fori_loop(0, r, inner)
        if pid == 1 and rank == 1:
            nl.fori_loop(0, 1, outer)
        else:
            nl.fori_loop(0, r, inner)
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out
    args = (nkisim.ShapeDtype((1, 4), "float32"), nkisim.ShapeDtype((1, 1), "int32"))
    with nkisim.register_values(lambda q: 3):
        msg = _refused(r"LNC-uniform control flow: rank 1: .*first difference at runtime loop #0",
                       nkisim.launch, k, [args + (0,), args + (1,)], tp=2, lnc=2)
        assert nkisim.launch(k, [args + (0,), args + (0,)], tp=2, lnc=2)[1] == args[0]     # legal twin
    assert f"core 1: fori_loop at {_line(k.fn, 'nl.fori_loop(0, 1, outer)')} (depth 0, 1 trips)" in msg
    assert "core 0: fori_loop at" in msg and "(depth 0, 3 trips)" in msg     # core 0: the loop at depth 0


def test_lnc_divergence_explains_a_deadlock():
    """Core 0 runs a loop with a barrier inside, core 1 does not: the launch would deadlock; the refusal names the
    divergence (the cause) and then the deadlock."""
    @nki.jit
    def k(x, n):
        pid = nl.program_id(0)
        t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        r = _load_reg(n)

        def body(i):
            nisa.core_barrier(data=out, cores=(0, 1))
        if pid == 0:
            nl.fori_loop(0, r, body)
        nisa.core_barrier(data=out, cores=(0, 1))
        nisa.dma_copy(dst=out, src=t)
        return out
    _refused(r"LNC-uniform control flow.*this left the launch deadlocked", k[2], np.zeros((1, 4), F32),
             np.array([[2]], I32))


def test_lnc_check_switch():
    k = _count_loop(None)
    hw.LNC_UNIFORM_CHECK = "off"
    try:
        out = k[2](np.zeros((1, 4), F32), np.array([[3], [2]], I32))
    finally:
        hw.LNC_UNIFORM_CHECK = "error"
    np.testing.assert_array_equal(out, [[3.0] * 4, [2.0] * 4])


# =====================================================================================================================
# 2. 32-bit integers (SDK-LG "NKI Values")
# =====================================================================================================================
BIG = 2 ** 31 + 8          # one stacked HBM tensor with more elements than int32 holds


def _copy_view(view_fn, dtype=nl.float32, n=8):
    @nki.jit
    def k(x):
        v = view_fn(x)
        t = nl.ndarray((1, n), dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=v)
        out = nl.ndarray((1, n), dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k


def _big_view_beyond(x):
    return x[BIG - 8:BIG].reshape((1, 8))


def _big_ap_offset(x):
    return x.ap(pattern=[[8, 1], [1, 8]], offset=BIG - 8)


def _big_view_inside(x):
    return x[0:8].reshape((1, 8))


def test_int32_view_element_offset_beyond_int32():
    big = nkisim.ShapeDtype((BIG,), "float32")
    with pytest.warns(NkiFidelityWarning, match=r"32-bit integers: tensor .* has 2147483656 elements"):
        _refused(rf"32-bit integers: the element offset of dma_copy: src .* is {BIG - 8}, outside the 32-bit integer "
                 rf"range .* at {_line(_copy_view, 'nisa.dma_copy(dst=t, src=v)')}; NKI integers are 32-bit \(SDK "
                 rf"nki-language-guide.rst 'NKI Values'\)", _copy_view(_big_view_beyond), big)


def test_int32_ap_offset():
    big = nkisim.ShapeDtype((BIG,), "float32")
    with pytest.warns(NkiFidelityWarning, match=r"32-bit integers: tensor .* has 2147483656 elements"):
        _refused(rf"32-bit integers: ap: offset is {BIG - 8}, outside .* at {_line(_big_ap_offset, 'x.ap(')}",
                 _copy_view(_big_ap_offset), big)


def test_int32_big_tensor_legal_twin_inside_int32():
    """A view of a huge tensor that stays below element 2**31 - 1 is fine (shape-only: no 8 GiB of data)."""
    big = nkisim.ShapeDtype((BIG,), "float32")
    with pytest.warns(NkiFidelityWarning, match="has 2147483656 elements"):
        out = _copy_view(_big_view_inside)(big)
    assert out == nkisim.ShapeDtype((1, 8), "float32")


def _int_kernel(operand, lo=0, hi=4, shape=(2, 4)):
    @nki.jit
    def k(x):
        t = nl.ndarray(shape, nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=operand)

        def body(i):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.subtract, operand0=1)
        nl.fori_loop(lo, hi, body)
        out = nl.ndarray(shape, nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k


def test_int32_scalar_operand_loop_bound_shape_and_argument():
    x = np.arange(8, dtype=I32).reshape(2, 4)
    _refused(rf"32-bit integers: tensor_scalar: operand0 is 2147483648, outside .* at "
             rf"{_line(_int_kernel, 'operand0=operand')}", _int_kernel(2 ** 31), x)
    _refused(rf"32-bit integers: nl.fori_loop: upper is 4294967296, outside .* at "
             rf"{_line(_int_kernel, 'nl.fori_loop(lo, hi, body)')}", _int_kernel(1, hi=2 ** 32), x)
    _refused(rf"32-bit integers: nl.ndarray: shape\[1\] is 2147483648, outside .* at "
             rf"{_line(_int_kernel, 't = nl.ndarray(shape')}", _int_kernel(1, shape=(2, 2 ** 31)), x)

    @nki.jit
    def k(x, n):
        return x
    _refused(r"32-bit integers: argument #1 of kernel k is 8589934592, outside .* at the kernel call", k, x, 2 ** 33)


def _min_kernel(operand):
    @nki.jit
    def k(x):
        t = nl.ndarray((2, 4), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.minimum, operand0=operand)
        out = nl.ndarray((2, 4), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k


def test_int32_legal_twin_at_the_edges():
    x = np.arange(8, dtype=I32).reshape(2, 4) - 4
    np.testing.assert_array_equal(_min_kernel(2 ** 31 - 1)(x), x)            # the int32 extremes are legal
    np.testing.assert_array_equal(_min_kernel(-2 ** 31)(x), np.full((2, 4), -2 ** 31))
    np.testing.assert_array_equal(_int_kernel(5, hi=3)(x), x + 5 - 3)


def test_int32_iota_offset_and_view_reaching_beyond_is_warned():
    @nki.jit
    def k(x):
        t = nl.ndarray((1, 4), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=t, pattern=[[1, 4]], offset=OFFSET[0])
        out = nl.ndarray((1, 4), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    OFFSET[0] = -2 ** 31 - 1
    _refused(r"32-bit integers: iota: \[offset, channel_multiplier\]\[0\] is -2147483649", k, np.zeros(1, F32))
    OFFSET[0] = -2 ** 31
    np.testing.assert_array_equal(k(np.zeros(1, F32)), [np.arange(4) - 2 ** 31])

    def reach_beyond(x):
        return x.ap(pattern=[[9, 1], [2 ** 28, 9]], offset=0)      # starts at 0, steps past element 2**31 - 1
    big = nkisim.ShapeDtype((2 ** 31 + 2 ** 28,), "int8")
    with pytest.warns(NkiFidelityWarning) as rec:
        _copy_view(reach_beyond, nl.int8, 9)(big)
    msgs = " | ".join(str(w.message) for w in rec)
    assert "has 2415919104 elements, more than int32 holds" in msgs
    assert re.search(r"32-bit integers: dma_copy: src .* starts at element 0 but reaches element 2147483648, beyond "
                     r"int32", msgs), msgs


OFFSET = [0]


# =====================================================================================================================
# 3. Classes (SDK-LG "Class Support", "Enumerations") and purity (SDK-LG "Kernel Caching")
# =====================================================================================================================
class Plain:
    def __init__(self, scale):
        self.scale = scale


class Mixed(nl.NKIObject, Plain):
    pass


class WithProperty(nl.NKIObject):
    def __init__(self, scale):
        self.scale = scale

    @property
    def double(self):
        return 2 * self.scale


class WithSlots(nl.NKIObject):
    __slots__ = ("scale",)

    def __init__(self, scale):
        self.scale = scale


@dataclass(frozen=True)
class Frozen(nl.NKIObject):
    scale: float = 1.0


class Mode(enum.IntEnum):
    add = 1


@dataclass
class Scale(nl.NKIObject):
    """A legal NKI class: NKIObject only, plain fields, a method."""
    scale: float = 1.0
    bias: float = 0.0

    def apply(self, t):
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=self.scale, op1=nl.add, operand1=self.bias)


class Op(enum.Enum):
    scale = 1
    skip = 2


def _scale_kernel():
    @nki.jit
    def k(x, cfg, op):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        if op == Op.scale:
            cfg.apply(t)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k


def test_class_legal_twin_nkiobject_dataclass_and_enum():
    x = np.arange(8, dtype=F32).reshape(2, 4)
    np.testing.assert_array_equal(_scale_kernel()(x, Scale(2.0, 1.0), Op.scale), 2 * x + 1)
    np.testing.assert_array_equal(_scale_kernel()(x, Scale(2.0, 1.0), Op.skip), x)
    np.testing.assert_array_equal(_frozen_kernel()(x, Frozen(3.0)), 3 * x)      # a frozen NKIObject dataclass


def _frozen_kernel():
    @nki.jit
    def k(x, cfg):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=cfg.scale)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k


@pytest.mark.parametrize("obj, why", [
    (Plain(2.0), r"it must inherit from nl.NKIObject and no other class .* its bases are \(object\)"),
    (Mixed(scale=1.0), r"Mixed derives from \(NKIObject, Plain\)"),
    (WithProperty(2.0), r"WithProperty.double is a property; only the object dictionary crosses"),
    (WithSlots(2.0), r"WithSlots declares __slots__"),
    (Mode.add, r"an enumeration must derive from Enum alone .* it derives from IntEnum"),
])
def test_class_rule_for_arguments(obj, why):
    x = np.zeros((2, 4), F32)
    msg = _refused(r"NKI classes: class \w+ \(test_kernel_rules.py:\d+\) reaches traced code \(argument #1 of kernel "
                   r"k.*'Class Support'", _scale_kernel(), x, obj, Op.skip)
    assert re.search(why, msg), msg


PLAIN_GLOBAL = Plain(3.0)


def _reads_global(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=PLAIN_GLOBAL.scale)
    return t


def _builds_object(x):
    w = WithProperty(2.0)
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=w.double)
    return t


def _wrap(helper):
    @nki.jit
    def k(x):
        t = helper(x)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k


def test_class_rule_for_globals_and_objects_built_inside():
    x = np.zeros((2, 4), F32)
    _refused(rf"NKI classes: class Plain .* reaches traced code \(_reads_global \({_line(_reads_global, 'PLAIN_GLOBAL')}"
             rf"\) reads global 'PLAIN_GLOBAL' \(a Plain object\)\)", _wrap(_reads_global), x)
    _refused(rf"NKI classes: class WithProperty .* reaches traced code \(_builds_object "
             rf"\({_line(_builds_object, 'WithProperty(2.0)')}\) reads global 'WithProperty'\).*property",
             _wrap(_builds_object), x)


LOOKUP = {"scale": 3.0}


def _reads_dict(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=LOOKUP["scale"])
    return t


SCALE = 3.0


def _reads_constant(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=SCALE)
    return t


def test_purity_mutable_global_is_warned_constant_is_fine():
    x = np.arange(8, dtype=F32).reshape(2, 4)
    with pytest.warns(NkiFrontendWarning, match=rf"kernel purity: _reads_dict \({_line(_reads_dict, 'LOOKUP')}\) "
                                                rf"reads global 'LOOKUP': module global 'LOOKUP' is a dict.*'Kernel "
                                                rf"Caching'"):
        np.testing.assert_array_equal(_wrap(_reads_dict)(x), 3 * x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NkiFidelityWarning)
        np.testing.assert_array_equal(_wrap(_reads_constant)(x), 3 * x)


# =====================================================================================================================
# 4. Runtime loops: no_reorder, steps, PSUM loop state (SDK-NL, nki-dynamic-loops.rst)
# =====================================================================================================================
def _loop_body_kernel(form):
    @nki.jit
    def k(x, n):
        acc = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=acc, src=x)
        r = _load_reg(n)

        def body(i):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
        if form == "dynamic_range_in_no_reorder":
            with nl.no_reorder():
                for i in nl.dynamic_range(r):
                    body(i)
        elif form == "fori_in_no_reorder_helper":
            with nl.no_reorder():
                _run_fori(r, body)                  # dynamic extent: the helper's loop is inside the block
        elif form == "step_negative":
            nl.fori_loop(4, 0, body, step=-1)
        elif form == "step_register":
            for i in nl.dynamic_range(0, 4, r):
                body(i)
        else:                                         # legal: no_reorder inside the body, positive step
            def ordered(i):
                with nl.no_reorder():
                    body(i)
            nl.fori_loop(0, r, ordered)
            for i in nl.dynamic_range(0, 4, 2):
                body(i)
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out
    return k


def _run_fori(r, body):
    nl.fori_loop(0, r, body)


def test_runtime_loop_in_no_reorder():
    x, n = np.zeros((1, 4), F32), np.array([[2]], I32)
    k = _loop_body_kernel("dynamic_range_in_no_reorder")
    _refused(rf"runtime loops: nl.dynamic_range at {_line(_loop_body_kernel, 'for i in nl.dynamic_range(r):')}: "
             rf"runtime loops are not supported inside an nl.no_reorder\(\) block \(opened at "
             rf"{_line(_loop_body_kernel, 'with nl.no_reorder():')}\).*This is NOT supported and will error", k, x, n)
    _refused(rf"runtime loops: nl.fori_loop at {_line(_run_fori, 'nl.fori_loop')}: runtime loops are not supported "
             rf"inside an nl.no_reorder", _loop_body_kernel("fori_in_no_reorder_helper"), x, n)


def test_runtime_loop_steps():
    x, n = np.zeros((1, 4), F32), np.array([[2]], I32)
    _refused(rf"runtime loops: nl.fori_loop: step must be a compile-time positive int .*got -1 at "
             rf"{_line(_loop_body_kernel, 'step=-1')}", _loop_body_kernel("step_negative"), x, n)
    _refused(r"runtime loops: nl.dynamic_range: step must be a compile-time positive int .*got VirtualRegister",
             _loop_body_kernel("step_register"), x, n)


def test_runtime_loops_legal_twin():
    out = _loop_body_kernel("legal")(np.zeros((1, 4), F32), np.array([[3]], I32))
    np.testing.assert_array_equal(out, np.full((1, 4), 3.0 + 2.0))


def _psum_kernel(form):
    @nki.jit
    def k(a, n):
        sa = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        r = _load_reg(n)
        acc = nl.ndarray((32, 32), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        ps = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=sa, moving=sa)            # an accumulation group opened before the loop

        def dve_into_outside(i):
            nisa.tensor_copy(dst=ps, src=sa, engine=nisa.vector_engine)

        def sbuf_state(i):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=sa, op=nl.add)
        nl.fori_loop(0, r, dve_into_outside if form == "dve_write" else sbuf_state)
        if form == "open_group":
            nisa.nc_matmul(dst=ps, stationary=sa, moving=sa)         # accumulates onto the pre-loop value
        res = nl.ndarray((32, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=res, data1=acc, data2=ps, op=nl.add)
        out = nl.ndarray((32, 32), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=res)
        return out
    return k


def test_psum_written_inside_runtime_loop_by_vector_engine():
    a, n = (np.arange(32 * 32, dtype=F32).reshape(32, 32) % 5) / 5, np.array([[2]], I32)
    _refused(rf"runtime loops: tensor_copy at {_line(_psum_kernel, 'nisa.tensor_copy(dst=ps')}: dst writes PSUM tensor "
             rf"'ps' .* that it was allocated outside of", _psum_kernel("dve_write"), a, n)


def test_psum_accumulator_live_across_runtime_loop_is_warned():
    a, n = (np.arange(32 * 32, dtype=F32).reshape(32, 32) % 5) / 5, np.array([[2]], I32)
    with pytest.warns(NkiFidelityWarning, match=rf"runtime loops: nc_matmul at "
                                                rf"{_line(_psum_kernel, 'accumulates onto the pre-loop')}: dst "
                                                rf"accumulates onto PSUM tensor 'ps' .* live across"):
        out = _psum_kernel("open_group")(a, n)
    np.testing.assert_allclose(out, 2 * a + 2 * (a.T @ a), rtol=1e-5)
    hw.LOOP_PSUM_LIVE = "error"
    try:
        _refused("live across", _psum_kernel("open_group"), a, n)
    finally:
        hw.LOOP_PSUM_LIVE = "warn"


# =====================================================================================================================
# 5. The NKI Python subset in every traced function; the public API surface
# =====================================================================================================================
def _geometry_is(n, flag):
    """A helper that issues no ISA call (the old lint never saw it)."""
    if flag is None:
        return n
    return 2 * n


def _geometry_keys(n):
    return {0: n}[0]


def _geometry_comprehension(n):
    return sum([c for c in range(n)])


def _helper_kernel(helper):
    @nki.jit
    def k(x):
        t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=float(helper(2)))
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k


def test_subset_in_helpers_that_issue_no_isa_call():
    """Helpers are linted although they issue no ISA call (the old lint never saw them): 'is' warns by default
    (nki-library's tested helpers use 'is None') and is refused with HELPER_ERRORS; a non-string dict key is refused
    in helpers too (SDK-LG 'NKI Values'; no counter-evidence in nki-library's function bodies)."""
    from nkisim import frontend
    x = np.zeros(1, F32)
    frontend._reached.clear()
    _refused(rf"NKI Python subset: helper _geometry_keys builds a dict with key 0 at "
             rf"{_line(_geometry_keys, '{0: n}')}", _helper_kernel(_geometry_keys), x)
    with pytest.warns(NkiFrontendWarning, match=rf"NKI Python subset: helper _geometry_is uses 'is' at "
                                                rf"{_line(_geometry_is, 'flag is None')}"):
        np.testing.assert_array_equal(_helper_kernel(lambda n: _geometry_is(n, 1))(x), np.full((1, 4), 4.0))
    frontend.HELPER_ERRORS = True
    frontend._reached.clear()
    try:
        _refused(rf"NKI Python subset: helper _geometry_is uses 'is' at {_line(_geometry_is, 'flag is None')}",
                 _helper_kernel(lambda n: _geometry_is(n, 1)), x)
    finally:
        frontend.HELPER_ERRORS = False
        frontend._reached.clear()


def test_subset_warnings_and_legal_twin():
    x = np.zeros(1, F32)
    with pytest.warns(NkiFrontendWarning, match=rf"helper _geometry_comprehension uses a list comprehension at "
                                                rf"{_line(_geometry_comprehension, '[c for c')}"):
        np.testing.assert_array_equal(_helper_kernel(_geometry_comprehension)(x), np.ones((1, 4)))

    @nki.jit
    def inner(x):
        t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)

        def fill(v):
            nisa.memset(dst=t, value=v)
        fill(2.0)
        try:
            pass
        finally:
            pass
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    with pytest.warns(NkiFrontendWarning) as rec:
        np.testing.assert_array_equal(inner(x), np.full((1, 4), 2.0))
    msgs = " | ".join(str(w.message) for w in rec)
    assert f"kernel inner uses an inner def (fill) at {_line(inner.fn, 'def fill')}" in msgs
    assert f"kernel inner uses a try statement at {_line(inner.fn, 'try:')}" in msgs
    # legal twin: the loop-body def and module-level helpers with explicit loops raise nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", NkiFidelityWarning)
        np.testing.assert_array_equal(_helper_kernel(_explicit_sum)(x), np.ones((1, 4)))
        np.testing.assert_array_equal(_loop_body_kernel("legal")(np.zeros((1, 4), F32), np.array([[1]], I32)),
                                      np.full((1, 4), 3.0))


def _explicit_sum(n):
    s = 0
    for c in range(n):
        s += c
    return s


def _undocumented_module_name(x):
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0 if nl.is_hbm(x.buffer) else 0.0)
    return nl.VirtualRegister


def _register_value(x):
    r = nisa.register_alloc(3)
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0)
    return r.value


def _tensor_internals(x):
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0)
    return t.storage


def test_api_undocumented_names_and_attributes():
    x = np.zeros((1, 4), F32)
    _refused(rf"undocumented API: _undocumented_module_name \({_line(_undocumented_module_name, 'nl.VirtualRegister')}"
             rf"\) reads nl.VirtualRegister: 'VirtualRegister' is not part of nki.language",
             _wrap(_undocumented_module_name), x)
    _refused(rf"undocumented API: _register_value \({_line(_register_value, 'r.value')}\) reads r.value: 'value' is "
             rf"not a documented attribute of nki.isa.VirtualRegister", _wrap(_register_value), x)
    _refused(rf"undocumented API: _tensor_internals \({_line(_tensor_internals, 't.storage')}\) reads t.storage",
             _wrap(_tensor_internals), x)


def _group_size(rg):
    return len(rg.groups)


def test_api_replica_group_fields_are_not_public():
    @nki.jit
    def k(x, rg):
        t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=float(_group_size(rg)))
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    rg = ncc.ReplicaGroup([[0, 1]])
    x = np.zeros((1, 4), F32)
    _refused(rf"undocumented API: _group_size \({_line(_group_size, 'rg.groups')}\) reads .groups of a ReplicaGroup",
             nkisim.launch, k, [(x, rg), (x, rg)], tp=2, lnc=1)
    assert rg.groups == [[0, 1]]                       # host code may read it


def _escape_kernel(form):
    @nki.jit
    def k(x, n):
        r = _load_reg(n)
        kept = []
        acc = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=acc, src=x)

        def body(i):
            t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=t, data=acc, op0=nl.add, operand0=1.0)
            nisa.tensor_copy(dst=acc, src=t)
            kept.append(t)
            if form == "returns":
                return t
        nl.fori_loop(0, r, body)
        if form == "escape":
            nisa.tensor_copy(dst=acc, src=kept[0])                  # the body's tile, used after the loop
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out
    return k


def test_tensor_of_a_loop_body_used_after_the_loop_and_body_return_value():
    x, n = np.zeros((1, 4), F32), np.array([[2]], I32)
    _refused(rf"runtime loops: tensor_copy at {_line(_escape_kernel, 'src=kept[0]')}: src is 't' .* allocated inside "
             rf"the body of a runtime loop .* cannot be referenced outside of the loop", _escape_kernel("escape"), x, n)
    _refused(rf"runtime loops: nl.fori_loop at {_line(_escape_kernel, 'nl.fori_loop(0, r, body)')}: body_fun returned a "
             rf"value", _escape_kernel("returns"), x, n)
    np.testing.assert_array_equal(_escape_kernel("legal")(x, n), np.full((1, 4), 2.0))


def test_shared_constant_must_not_diverge_across_cores():
    @nki.jit
    def k(x):
        pid = nl.program_id(0)
        c = nl.shared_constant(np.full((1, 4), 1.0 + pid * DIVERGE[0], np.float32))
        t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=c)
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=t)
        return out
    DIVERGE[0] = 1.0
    _refused(rf"nl.shared_constant at {_line(k.fn, 'nl.shared_constant(')}: core 1 passes other data than core 0 .* "
             rf"must not diverge across cores", k[2], np.zeros(1, F32))
    DIVERGE[0] = 0.0
    np.testing.assert_array_equal(k[2](np.zeros(1, F32)), np.ones((2, 4)))


DIVERGE = [0.0]


def test_lnc_must_match_neuron_logical_nc_config(monkeypatch):
    k = _count_loop(None)
    x, n = np.zeros((1, 4), F32), np.array([[1], [1]], I32)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    _refused(r"launched at LNC=2 but NEURON_LOGICAL_NC_CONFIG=1; 'The LNC value must match", k[2], x, n)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    np.testing.assert_array_equal(k[2](x, n), np.ones((2, 4)))


def test_affine_select_on_false_value_is_float32():
    @nki.jit
    def k(x):
        t = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.affine_select(dst=t, pattern=[[1, 4]], channel_multiplier=-1, on_true_tile=t, on_false_value=FALSE[0],
                           cmp_op=nl.greater_equal)
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    x = np.arange(8, dtype=F32).reshape(2, 4) + 1
    FALSE[0] = 0
    _refused(r"affine_select: on_false_value must be a float32 value .* got the int 0", k, x)
    FALSE[0] = 0.0
    want = np.where(np.arange(4)[None, :] - np.arange(2)[:, None] >= 0, x, 0.0)
    np.testing.assert_array_equal(k(x), want)


FALSE = [0.0]


def test_public_api_module_matches_the_api_json():
    """nkisim/public_api.py is ../shared/docs/nki-api-0.6.json (plus nki.isa.constants, which the stubs omit)."""
    import json
    import os
    from nkisim import public_api
    spec = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "docs", "nki-api-0.6.json")
    if not os.path.exists(spec):
        pytest.skip("../shared/docs/nki-api-0.6.json not present")
    d = json.load(open(spec))["modules"]
    for m, v in d.items():
        assert public_api.MODULES[m] == set(v["functions"]) | set(v["enums"]) | set(v["classes"]) | set(v["constants"])
        for c, cv in v["classes"].items():
            assert public_api.CLASSES[f"{m}.{c}"] == set(cv["methods"]) | set(cv["attributes"])
        for e, members in v["enums"].items():
            assert public_api.ENUMS[f"{m}.{e}"] == set(members)
    assert set(public_api.MODULES) == set(d) | {"nki.isa.constants"}
    assert public_api.MODULES["nki.isa.constants"] <= public_api.MODULES["nki.isa"]


def _uses_nkisim_internals(x):
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=float(hw.PMAX))
    return t


def _prints_a_number(x):
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0)
    nl.device_print(7, t)
    return t


def _huge_slice_step(x):
    return x[0:1, ::2 ** 31]


def test_api_nkisim_internals_device_print_and_slice_step():
    x = np.zeros((1, 4), F32)
    _refused(rf"undocumented API: _uses_nkisim_internals \({_line(_uses_nkisim_internals, 'hw.PMAX')}\) uses module "
             rf"'nkisim.hw' \(nkisim's own implementation\); kernels import only the NKI API", _wrap(_uses_nkisim_internals),
             x)
    _refused(r"nl.device_print: print_prefix must be a constant string", _wrap(_prints_a_number), x)
    _refused(rf"32-bit integers: slice step of dim 1 is 2147483648, outside .* at "
             rf"{_line(_huge_slice_step, '2 ** 31')}", _copy_view(_huge_slice_step, n=1), x)
