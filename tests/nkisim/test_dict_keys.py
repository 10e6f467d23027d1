"""NKI dict keys must be strings (SDK nki-language-guide.rst "NKI Values": "Dictionaries with string-value keys",
"the keys must be string values"). Literal keys are checked in the source (test_kernel_rules.py); these tests cover
dicts built at run time: seen in the locals of traced functions at ISA calls (passed to a helper, built in it, handed
back to a caller that calls on), inside NKIObject arguments, and in the kernel's return value. Module-global dicts with
non-string keys are warned (AWS's nki-library reads enum-keyed global dicts in traced helpers)."""
import enum
import re

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim.frontend import NkiFrontendWarning

F32 = np.float32


def _refused(match, fn, *args):
    with pytest.raises(nkisim.NkiValidationError) as e:
        fn(*args)
    assert re.search(match, str(e.value), re.S), str(e.value)


def _table(n, key):
    """A dict built at run time; key(i) gives the key of entry i."""
    d = {}
    for i in range(n):
        d[key(i)] = 2.0 * i
    return d


def _fill(t, value):
    nisa.memset(dst=t, value=value)


def _fill_from(t, table, key):
    nisa.memset(dst=t, value=table[key])


def _out(t):
    out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def _str_key(i):
    return "k" + str(i)


def _int_key(i):
    return i


@nki.jit
def passed_to_helper(x):
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    table = _table(3, _int_key)
    _fill_from(t, table, 1)
    return _out(t)


@nki.jit
def handed_back(x):
    """The helper's dict comes back to the kernel frame, which then calls another helper."""
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    _fill(t, 0.0)
    table = _table(3, _int_key)
    _fill(t, table[2])
    return _out(t)


@nki.jit
def string_keys(x):
    """Legal twin: the same tables with string keys."""
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    _fill(t, 0.0)
    table = _table(3, _str_key)
    _fill_from(t, table, "k1")
    u = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    _fill(u, table["k2"])
    nisa.tensor_tensor(dst=t, data1=t, data2=u, op=nl.add)
    return _out(t)


def test_runtime_dicts_in_traced_frames():
    x = np.zeros((1, 1), F32)
    _refused(r"NKI Python subset: _fill_from \(test_dict_keys.py:\d+\): 'table' is a dict with the non-string key 0; "
             r"NKI dict keys must be strings \(SDK nki-language-guide.rst 'NKI Values'", passed_to_helper, x)
    _refused(r"NKI Python subset: handed_back \(test_dict_keys.py:\d+\): 'table' is a dict with the non-string key 0",
             handed_back, x)
    np.testing.assert_array_equal(string_keys(x), np.full((1, 4), 6.0))     # 2.0 + 4.0


class Config(nl.NKIObject):
    def __init__(self, scales):
        self.scales = scales


@nki.jit
def config_kernel(x, cfg):
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    _fill(t, cfg.scales["a"])
    return _out(t)


def test_dict_inside_an_nkiobject_argument():
    x = np.zeros((1, 1), F32)
    _refused(r"argument #1 of kernel config_kernel.scales is a dict with the non-string key 1; NKI dict keys must be "
             r"strings", config_kernel, x, Config({"a": 1.0, 1: 2.0}))
    np.testing.assert_array_equal(config_kernel(x, Config({"a": 3.0})), np.full((1, 4), 3.0))


@nki.jit
def returns_int_keys(x):
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    _fill(t, 1.0)
    outs = {}
    outs[0] = _out(t)
    return outs


@nki.jit
def returns_str_keys(x):
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    _fill(t, 1.0)
    outs = {}
    outs["y"] = _out(t)
    return outs


def test_returned_dict():
    x = np.zeros((1, 1), F32)
    _refused(r"kernel returns_int_keys returns a dict with non-string key\(s\) \[0\]; NKI dict keys must be strings",
             returns_int_keys, x)
    np.testing.assert_array_equal(returns_str_keys(x)["y"], np.ones((1, 4)))


class Act(enum.Enum):
    SILU = 1
    GELU = 2


_SCALE_OF = {Act.SILU: 1.5, Act.GELU: 2.5}      # enum-keyed module global, as nki-library's _act_fn_map


def _scale(act):
    return _SCALE_OF[act]


@nki.jit
def global_table(x):
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    _fill(t, _scale(Act.GELU))
    return _out(t)


def test_module_global_dict_with_enum_keys_is_warned():
    with pytest.warns(NkiFrontendWarning, match=r"_SCALE_OF' is a dict with the non-string key <Act.SILU: 1>; NKI dict "
                                                r"keys must be strings .* Warned, not refused, for module globals"):
        out = global_table(np.zeros((1, 1), F32))
    np.testing.assert_array_equal(out, np.full((1, 4), 2.5))
