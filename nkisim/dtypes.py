"""NKI dtypes: the names kernels compare against (``nl.bfloat16 == 'bfloat16'``, ref §3.1) and
their numpy/ml_dtypes storage types, plus the round-on-write cast every engine performs."""
import numpy as np
import ml_dtypes

# name -> numpy storage dtype (SDK-SHARED tbl-dtype; ref §4 "Allowed dtypes").
# tfloat32 is stored as fp32 (its 10-bit mantissa matters only as a matmul input, ref §10.4).
# Packed x4 types (v4 MX only) are stored as raw 32-bit words.
DType = str      # nki.language.DType (and nki.dtype): dtypes are named by strings (ref §3.1)
_STORAGE = {
    "bool_": np.dtype(np.uint8),
    "int8": np.dtype(np.int8), "int16": np.dtype(np.int16), "int32": np.dtype(np.int32),
    "uint8": np.dtype(np.uint8), "uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32),
    "float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16), "tfloat32": np.dtype(np.float32),
    "float8_e4m3": np.dtype(ml_dtypes.float8_e4m3), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2), "float8_e8m0fnu": np.dtype(ml_dtypes.float8_e8m0fnu),
    "float8_e5m2_x4": np.dtype(np.uint32), "float8_e4m3fn_x4": np.dtype(np.uint32),
    "float4_e2m1fn_x4": np.dtype(np.uint32),
}
ALL = tuple(_STORAGE)
INTEGER = frozenset({"bool_", "int8", "int16", "int32", "uint8", "uint16", "uint32"})
FLOAT = frozenset(ALL) - INTEGER
PACKED = frozenset({"float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4"})

# numpy dtype -> canonical name (for kernel arguments)
_FROM_NP = {np.dtype(np.bool_): "bool_"}
for _n, _d in _STORAGE.items():
    if _n not in ("bool_", "tfloat32") and _n not in PACKED:
        _FROM_NP.setdefault(_d, _n)


def normalize(dtype, what="dtype"):
    """Accept an NKI dtype name, a numpy/ml_dtypes dtype or a torch dtype; return the NKI name."""
    if isinstance(dtype, str):
        if dtype in _STORAGE:
            return dtype
        if dtype == "bool":
            return "bool_"
        raise TypeError(f"{what}: unknown NKI dtype {dtype!r}; expected one of {', '.join(ALL)}")
    tname = getattr(dtype, "__module__", "")
    if type(dtype).__name__ == "dtype" and tname == "torch":
        return _torch_name(dtype, what)
    try:
        d = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what}: {dtype!r} is not a dtype") from None
    if d in _FROM_NP:
        return _FROM_NP[d]
    raise TypeError(f"{what}: numpy dtype {d} has no NKI equivalent (no 64-bit types inside kernels, "
                    f"ref §4); expected one of {', '.join(ALL)}")


def _torch_name(tdt, what):
    import torch
    table = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
             torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.uint8: "uint8",
             torch.bool: "bool_"}
    for attr, name in (("uint16", "uint16"), ("uint32", "uint32"), ("float8_e4m3fn", "float8_e4m3fn"),
                       ("float8_e5m2", "float8_e5m2")):
        if hasattr(torch, attr):
            table[getattr(torch, attr)] = name
    if tdt in table:
        return table[tdt]
    raise TypeError(f"{what}: torch dtype {tdt} has no NKI equivalent")


def storage(name):
    return _STORAGE[name]


def itemsize(name):
    return _STORAGE[name].itemsize


def is_int(name):
    return name in INTEGER


def is_float(name):
    return name in FLOAT


_INT_RANGE = {n: (np.iinfo(_STORAGE[n]).min, np.iinfo(_STORAGE[n]).max) for n in INTEGER}
_INT_RANGE["bool_"] = (0, 1)


def cast(values, name):
    """Cast computed values (fp32 or exact ints) to dtype `name` the way the engines write:
    floats round to nearest even (ml_dtypes / numpy casts are RNE); fp32 -> int rounds to nearest
    even and saturates to the destination range (ref §8, SDK-RN 0.6.0)."""
    st = _STORAGE[name]
    v = np.asarray(values)
    if name in INTEGER:
        lo, hi = _INT_RANGE[name]
        if v.dtype.kind == "f":
            v = np.rint(v.astype(np.float64, copy=False))
            v = np.nan_to_num(v, nan=0.0, posinf=hi, neginf=lo)
        return np.clip(v, lo, hi).astype(st)
    if name == "tfloat32":
        return v.astype(np.float32)
    if v.dtype.kind in "iub" and st.itemsize < 4:
        v = v.astype(np.float32)
    return v.astype(st)


def to_f32(arr):
    """Engine input conversion: every arithmetic engine reads its inputs as fp32 (ref §8)."""
    return np.asarray(arr).astype(np.float32, copy=False)
