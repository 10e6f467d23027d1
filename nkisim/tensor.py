"""NkiTensor: a strided view (shape, byte strides, byte offset, dtype) of one Storage.

Rules implemented (ref §3.2, §3.3): partition dim is dim 0 of SBUF/PSUM tensors; indexing with
ints / slices / ``nl.ds`` / ``...`` returns views sharing storage; on-chip an int on dim 0 keeps a
size-1 partition dim and an int on a free dim drops it unless the result would be < 2-D; on HBM
ints drop dims. ``.ap()`` addresses the underlying storage and ignores the view's own shape/strides.
"""
import math

import numpy as np

from . import dtypes, hw, int32
from .errors import NkiValidationError, OutOfBoundsError, UninitializedReadError
from .memory import ON_CHIP, HBM, PSUM, SBUF, materialize, written_array


def ds(start, size):
    """``nl.ds(start, size)``: the slice ``start : start + size``."""
    if not isinstance(start, (int, np.integer)) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"nl.ds: start and size must be Python ints (got {type(start).__name__}, "
                        f"{type(size).__name__}); for a runtime offset use t.ap(..., scalar_offset=reg)")
    return slice(int(start), int(start) + int(size))


def _extent(offset, shape, strides, itemsize):
    lo = hi = offset
    for n, s in zip(shape, strides):
        if n == 0:
            return offset, offset
        if s > 0:
            hi += s * (n - 1)
        else:
            lo += s * (n - 1)
    return lo, hi + itemsize


class Indirect:
    """Dynamic addressing attached by ``.ap(scalar_offset=...)`` / ``.ap(vector_offset=...)``."""
    __slots__ = ("kind", "index", "dim", "unit", "limit")

    def __init__(self, kind, index, dim, unit, limit=None):
        self.kind, self.index, self.dim, self.unit = kind, index, dim, unit   # unit: bytes per index step
        self.limit = limit          # select(dim, t): the index must be < limit (size of the selected dim)


class NkiTensor:
    """A tensor view. Public attributes follow SDK-NL: shape, strides, offset, dtype, buffer, ndim,
    size, name (strides/offset in elements of ``dtype``)."""
    # Views are immutable, so derived facts are cached on them: ``size``/``itemsize`` (plain attributes),
    # ``_geom`` (start partition, partitions, free), ``_np``/``_m`` (numpy views of the data / written mask,
    # direct views only) and ``_cov`` (the view covers every byte of its storage exactly once).
    __slots__ = ("storage", "dtype", "shape", "bstrides", "boffset", "indirect", "_geom", "size", "itemsize",
                 "_np", "_m", "_cov")

    def __init__(self, storage, dtype, shape, bstrides, boffset, indirect=None):
        self._geom = self._np = self._m = self._cov = None
        self.storage = storage
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.bstrides = tuple(int(s) for s in bstrides)
        self.boffset = int(boffset)
        self.indirect = indirect
        n = 1
        for d in self.shape:
            n *= d
        self.size = n
        self.itemsize = _ITEMSIZE[dtype]

    @classmethod
    def whole(cls, storage):
        strides = storage.cstrides
        if strides is None:
            key = (storage.shape, storage.dtype)
            strides = _CSTRIDES.get(key)
            if strides is None:
                isz = _ITEMSIZE[storage.dtype]
                st, acc = [], isz
                for d in reversed(storage.shape):
                    st.append(acc)
                    acc *= d
                if len(_CSTRIDES) > 4096:
                    _CSTRIDES.clear()
                strides = _CSTRIDES[key] = tuple(reversed(st))
            storage.cstrides = strides
        v = object.__new__(cls)
        v.storage, v.dtype, v.shape, v.bstrides, v.boffset = storage, storage.dtype, storage.shape, strides, 0
        v.indirect = v._np = v._m = None
        v._cov = True
        n = v.size = storage.nelems
        v.itemsize = _ITEMSIZE[storage.dtype]
        p = storage.shape[0]
        # an on-chip whole tensor at partition 0 passes every geom() check (see isa.common.geom)
        v._geom = (0, p, n // p, True) if storage.onchip and storage.address[0] == 0 and p <= hw.PMAX else None
        return v

    # ---- attributes ------------------------------------------------------------------------
    @property
    def buffer(self):
        return self.storage.kind

    @property
    def name(self):
        return self.storage.name

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def strides(self):
        return tuple(s // self.itemsize for s in self.bstrides)

    @property
    def offset(self):
        return self.boffset // self.itemsize

    @property
    def on_chip(self):
        return self.storage.onchip

    def __repr__(self):
        return (f"NkiTensor({self.storage.name}, {self.storage.kind.value}, {self.dtype}{list(self.shape)}"
                f"{', indirect' if self.indirect else ''})")

    def describe(self):
        return self.storage.describe(self.dtype, self.shape)

    def __len__(self):
        return self.shape[0]

    def __bool__(self):
        raise TypeError("NkiTensor has no truth value at trace time; kernels must not branch on tensor "
                        "values (use a register and nl.fori_loop / nl.while_loop for runtime control flow)")

    def __iter__(self):
        raise TypeError("NkiTensor is not iterable; index it explicitly")

    def __setitem__(self, key, value):
        raise NkiValidationError("NkiTensor.__setitem__ (tensor assignment) is refused: nkisim does not model it; "
                                 "write with an nisa.* instruction (dst=t[...])")

    @classmethod
    def _fast(cls, storage, dtype, shape, bstrides, boffset, size=None):
        """Constructor for already-normalised tuples of ints (hot path)."""
        v = object.__new__(cls)
        v.storage, v.dtype, v.shape, v.bstrides, v.boffset = storage, dtype, shape, bstrides, boffset
        v.indirect = v._geom = v._np = v._m = v._cov = None
        if size is None:
            size = 1
            for d in shape:
                size *= d
        v.size = size
        v.itemsize = _ITEMSIZE[dtype]
        return v

    def _new(self, shape, bstrides, boffset, dtype=None):
        if len(shape) > hw.VIEW_MAX_DIMS and self.storage.onchip:     # reshape / expand_dim / rearrange
            raise NkiValidationError(f"view: an on-chip view has at most {hw.VIEW_MAX_DIMS} dims (SDK-LG 'Tensor "
                                     f"Values': 'a strided access pattern with up to 5 dimensions'); "
                                     f"{self.describe()} would become {list(shape)}")
        v = NkiTensor._fast(self.storage, dtype or self.dtype, tuple(int(x) for x in shape),
                            tuple(int(x) for x in bstrides), int(boffset))
        v._check_bounds("indexing")
        return v

    def _check_bounds(self, what):
        lo, hi = _extent(self.boffset, self.shape, self.bstrides, self.itemsize)
        if self.size and (lo < 0 or hi > self.storage.nbytes):
            raise OutOfBoundsError(f"{what}: view {self.dtype}{list(self.shape)} at byte offset {self.boffset} "
                                   f"spans bytes [{lo}, {hi}) outside tensor {self.storage.describe()} "
                                   f"({self.storage.nbytes} B)")

    def _no_indirect(self, what):
        if self.indirect is not None:
            raise NkiValidationError(f"{what}: a tensor with a dynamic (indirect) access pattern cannot be "
                                     f"indexed, sliced or reshaped further (ref §3.2)")

    # ---- indexing --------------------------------------------------------------------------
    def __getitem__(self, key):
        """Fast path for keys made only of Python ints and step-1 int/None slices (the common case); anything
        else takes the general path. Both give the same view and the same errors. No bounds check of the result
        is needed: every index is validated, so the view is a subset of this (in-bounds) view."""
        if self.indirect is not None:
            self._no_indirect("NkiTensor.__getitem__")
        if type(key) is not tuple:
            key = (key,)
        shape, bstr = self.shape, self.bstrides
        nd = len(shape)
        if len(key) > nd:
            return self._getitem(key)
        nshape, nstr = [], []
        off = self.boffset
        size = 1
        dropped = None
        has_int = False
        onchip = self.storage.onchip
        for d, k in enumerate(key):
            tk = type(k)
            n = shape[d]
            if tk is slice:
                a, b = k.start, k.stop
                if k.step is not None or (a is not None and type(a) is not int) or \
                        (b is not None and type(b) is not int):
                    return self._getitem(key)
                if a is None:
                    a = 0
                elif a < 0:
                    if a < -n:
                        return self._getitem(key)
                    a += n
                elif a > n:
                    return self._getitem(key)
                if b is None:
                    b = n
                elif b < 0:
                    if b < -n:
                        return self._getitem(key)
                    b += n
                elif b > n:
                    return self._getitem(key)
                cnt = b - a if b > a else 0
                nshape.append(cnt)
                s = bstr[d]
                nstr.append(s)
                if cnt:
                    off += s * a
                size *= cnt
            elif tk is int:
                if not -n <= k < n:
                    return self._getitem(key)
                has_int = True
                if k < 0:
                    k += n
                off += bstr[d] * k
                if not (onchip and d == 0):
                    if dropped is None:
                        dropped = []
                    dropped.append(len(nshape))
                nshape.append(1)
                nstr.append(bstr[d])
            else:
                return self._getitem(key)
        for d in range(len(key), nd):
            nshape.append(shape[d])
            nstr.append(bstr[d])
            size *= shape[d]
        if dropped is not None:
            keep = [i for i in range(len(nshape)) if i not in dropped]
            if onchip and len(keep) < 2:
                # keep the last free dim at size 1 so the result stays >= 2-D (ref §3.2)
                last_free = len(nshape) - 1 if len(nshape) > 1 else None
                if last_free is not None and last_free not in keep:
                    keep = sorted(keep + [last_free])
            nshape = [nshape[i] for i in keep]
            nstr = [nstr[i] for i in keep]
            return NkiTensor._fast(self.storage, self.dtype, tuple(nshape), tuple(nstr), off, size)
        v = NkiTensor._fast(self.storage, self.dtype, tuple(nshape), tuple(nstr), off, size)
        if self._np is not None and not has_int:
            v._np = self._np[key]          # same view as raw(v) would build, by cheaper numpy slicing
        return v

    def _getitem(self, key):
        """General indexing (Ellipsis, numpy ints, steps, tensor indices, and every error message)."""
        self._no_indirect("NkiTensor.__getitem__")
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise IndexError(f"too many indices ({len(key)}) for tensor {self.describe()}")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, off, dropped = [], [], self.boffset, []
        for d, (k, n, s) in enumerate(zip(key, self.shape, self.bstrides)):
            if isinstance(k, slice):
                for v in (k.start, k.stop, k.step):
                    if v is not None and not isinstance(v, (int, np.integer)):
                        raise TypeError(f"index of dim {d} of {self.describe()}: slice bounds must be Python "
                                        f"ints, got {type(v).__name__} (runtime offsets need .ap(scalar_offset=))")
                step = 1 if k.step is None else int32.check(int(k.step), f"slice step of dim {d}")
                if step == 0:
                    raise IndexError("slice step cannot be zero")
                start, stop, _ = k.indices(n)
                for v in (k.start, k.stop):
                    if v is not None and not (-n <= int(v) <= n):
                        raise IndexError(f"slice {k.start}:{k.stop} out of range for dim {d} (size {n}) "
                                         f"of {self.describe()}")
                cnt = len(range(start, stop, step))
                shape.append(cnt)
                strides.append(s * step)
                off += s * start if cnt else 0
            elif isinstance(k, (int, np.integer)):
                k = int(k)
                if not -n <= k < n:
                    raise IndexError(f"index {k} out of range for dim {d} (size {n}) of {self.describe()}")
                k %= n
                off += s * k
                if self.on_chip and d == 0:
                    shape.append(1)
                    strides.append(s)
                else:
                    dropped.append(len(shape))
                    shape.append(1)
                    strides.append(s)
            elif isinstance(k, NkiTensor):
                # t[..., idx_tensor, ...] = static indexing of the other dims, then .select(dim, idx_tensor)
                tk = list(key)
                tk[d] = slice(None)
                rest = self[tuple(tk)]
                nd = d - sum(1 for j, kk in enumerate(key[:d]) if isinstance(kk, (int, np.integer))
                             and not (self.on_chip and j == 0))
                return rest.select(nd, k)
            else:
                raise TypeError(f"unsupported index {k!r} for dim {d} of {self.describe()}")
        keep = [i for i in range(len(shape)) if i not in dropped]
        if self.on_chip and len(keep) < 2:
            # keep the last free dim at size 1 so the result stays >= 2-D (ref §3.2)
            last_free = max([i for i in range(1, len(shape))], default=None)
            if last_free is not None and last_free not in keep:
                keep = sorted(keep + [last_free])
        shape = [shape[i] for i in keep]
        strides = [strides[i] for i in keep]
        return self._new(shape, strides, off)

    # ---- 0.5.0 view methods (ref §3.2) ------------------------------------------------------
    def slice(self, dim, start, end, step=1):
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim, index):
        if isinstance(index, NkiTensor):
            return self._dynamic_select(dim, index)
        v = self.slice(dim, index, index + 1)
        if self.on_chip and dim == 0:
            return v
        return v.squeeze_dim(dim) if (not self.on_chip or v.ndim > 2) else v

    def _dynamic_select(self, dim, index):
        """select(dim, idx) with a (1, 1) SBUF index tensor (NKI 0.5.0): a runtime offset along ``dim``, which is
        dropped. Rules (ref §3.2): one dynamic select per tensor; on-chip it cannot target dim 0."""
        op = "select"
        if self.indirect is not None:
            raise NkiValidationError(f"{op}: {self.describe()} already has a dynamic access; only one dynamic select "
                                     f"per tensor (ref §3.2)")
        dim = dim % self.ndim
        if self.on_chip and dim == 0:
            raise NkiValidationError(f"{op}: a dynamic select on an on-chip tensor cannot target the partition dim 0")
        if index.size != 1 or index.storage.kind != SBUF or not dtypes.is_int(index.dtype):   # SDK-AP: "in SBUF"
            raise NkiValidationError(f"{op}: a tensor index must be a (1, 1) integer SBUF tensor, got {index.describe()}")
        keep = [i for i in range(self.ndim) if i != dim]
        if self.on_chip and len(keep) < 2:
            v = NkiTensor._fast(self.storage, self.dtype, (self.shape[0], 1), (self.bstrides[0], self.itemsize),
                                self.boffset)
        else:
            v = NkiTensor._fast(self.storage, self.dtype, tuple(self.shape[i] for i in keep),
                                tuple(self.bstrides[i] for i in keep), self.boffset)
        v.indirect = Indirect("scalar", index, dim, self.bstrides[dim], limit=self.shape[dim])
        return v

    def vector_select(self, dim, index):
        """HBM only: row ``index[p]`` of dim 0 for every row p of the result (a gather, NKI 0.5.0)."""
        op = "vector_select"
        if dim != 0:
            raise NkiValidationError(f"{op}: only dim 0 is supported, got {dim}")
        if self.on_chip:
            raise NkiValidationError(f"{op}: vector_select is for HBM tensors, got {self.describe()}")
        if self.indirect is not None:
            raise NkiValidationError(f"{op}: {self.describe()} already has a dynamic access")
        if not isinstance(index, NkiTensor) or index.storage.kind != SBUF or index.ndim != 2 or \
                index.shape[1] != 1 or not dtypes.is_int(index.dtype):        # SDK-AP: "offsets in SBUF"
            raise NkiValidationError(f"{op}: index must be an integer (P, 1) SBUF tensor, got {index!r}")
        v = NkiTensor._fast(self.storage, self.dtype, (index.shape[0],) + self.shape[1:], (0,) + self.bstrides[1:],
                            self.boffset)
        v.indirect = Indirect("vector", index, 0, self.bstrides[0], limit=self.shape[0])
        return v

    def permute(self, dims):
        self._no_indirect("permute")
        dims = tuple(dims)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute: {dims} is not a permutation of {self.ndim} dims")
        if self.on_chip and dims[0] != 0:
            raise NkiValidationError(f"permute: on-chip tensors keep the partition dim first (dims[0] must be 0, "
                                     f"got {dims[0]})")
        return self._new([self.shape[d] for d in dims], [self.bstrides[d] for d in dims], self.boffset)

    def broadcast(self, dim, size):
        self._no_indirect("broadcast")
        if self.shape[dim] != 1:
            raise ValueError(f"broadcast: dim {dim} has size {self.shape[dim]}, expected 1")
        if self.on_chip and dim == 0:
            raise NkiValidationError("broadcast: cannot broadcast the partition dim of an on-chip tensor")
        shape, st = list(self.shape), list(self.bstrides)
        shape[dim], st[dim] = size, 0
        return self._new(shape, st, self.boffset)

    def expand_dim(self, dim):
        self._no_indirect("expand_dim")
        if self.on_chip and dim == 0:       # SDK-NL NkiTensor.expand_dim: "On-chip tensors: dim must not be 0"
            raise NkiValidationError(f"expand_dim: cannot insert a dim before the partition dim of on-chip tensor "
                                     f"{self.describe()}; use dim >= 1")
        shape, st = list(self.shape), list(self.bstrides)
        shape.insert(dim, 1)
        st.insert(dim, st[dim] if dim < len(st) else self.itemsize)
        return self._new(shape, st, self.boffset)

    def squeeze_dim(self, dim):
        self._no_indirect("squeeze_dim")
        if self.shape[dim] != 1:
            raise ValueError(f"squeeze_dim: dim {dim} has size {self.shape[dim]}, expected 1")
        if self.on_chip and (dim == 0 or self.ndim <= 2):
            raise NkiValidationError("squeeze_dim: on-chip tensors keep the partition dim and stay >= 2-D")
        shape, st = list(self.shape), list(self.bstrides)
        del shape[dim], st[dim]
        return self._new(shape, st, self.boffset)

    def reshape_dim(self, dim, shape):
        new = list(self.shape[:dim]) + list(shape) + list(self.shape[dim + 1:])
        return self.reshape(new)

    def flatten_dims(self, start_dim, end_dim):
        n = 1
        for s in self.shape[start_dim:end_dim + 1]:
            n *= s
        return self.reshape(list(self.shape[:start_dim]) + [n] + list(self.shape[end_dim + 1:]))

    def reshape(self, shape):
        self._no_indirect("reshape")
        shape = [int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,))]
        if -1 in shape:
            known = math.prod([s for s in shape if s != -1])
            shape[shape.index(-1)] = self.size // max(known, 1)
        if math.prod(shape) != self.size:
            raise ValueError(f"reshape: {list(self.shape)} has {self.size} elements, {shape} has "
                             f"{math.prod(shape)} (reshape must preserve the element count, NKI 0.5.0)")
        if self.on_chip and shape[0] != self.shape[0]:
            raise NkiValidationError(f"reshape: on-chip reshape must keep the partition dim ({self.shape[0]}), "
                                     f"got {shape[0]}")
        # derive strides the way numpy would for a no-copy reshape; refuse layouts that need a copy
        key = (self.shape, self.bstrides, tuple(shape))
        strides = _RESHAPE.get(key, 0)
        if strides == 0:
            dummy = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), self.shape, self.bstrides)
            try:
                strides = np.reshape(dummy, shape, copy=False).strides
            except ValueError:
                strides = None
            if len(_RESHAPE) > 4096:
                _RESHAPE.clear()
            _RESHAPE[key] = strides
        if strides is None:
            raise NkiValidationError(f"reshape: view with shape {list(self.shape)} and byte strides "
                                     f"{list(self.bstrides)} cannot be reshaped to {shape} without a copy")
        return self._new(shape, strides, self.boffset)

    def view(self, dtype):
        self._no_indirect("view")
        dt = dtypes.normalize(dtype, "view")
        new = dtypes.itemsize(dt)
        old = self.itemsize
        if new == old:
            return self._new(self.shape, self.bstrides, self.boffset, dt)
        if self.bstrides[-1] != old and self.shape[-1] != 1:
            raise NkiValidationError(f"view: reinterpreting as {dt} needs a contiguous last dim "
                                     f"(byte stride {self.bstrides[-1]}, itemsize {old})")
        last_bytes = self.shape[-1] * old
        if last_bytes % new or self.boffset % new or any(s % new for s in self.bstrides[:-1]):
            raise NkiValidationError(f"view: {self.dtype}{list(self.shape)} cannot be reinterpreted as {dt}: last "
                                     f"dim is {last_bytes} B, not a multiple of {new}, or misaligned")
        shape = list(self.shape[:-1]) + [last_bytes // new]
        return self._new(shape, list(self.bstrides[:-1]) + [new], self.boffset, dt)

    def get_pattern(self):
        return [[s // self.itemsize, n] for s, n in zip(self.bstrides, self.shape)]

    def is_contiguous(self):
        acc = self.itemsize
        for n, s in reversed(list(zip(self.shape, self.bstrides))):
            if n != 1 and s != acc:
                return False
            acc *= n
        return True

    def is_indirect(self):
        return self.indirect is not None

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None):
        """einops-style view change (NKI 0.5.0): ``src_pattern`` names every current dim, a tuple splitting it
        (sizes from ``fixed_sizes``, at most one unknown per group); ``dst_pattern`` orders the names, a tuple
        merging them. Splits/permutes are always views; a merge of non-adjacent strides is refused (as reshape)."""
        op = "rearrange"
        self._no_indirect(op)
        fixed = dict(fixed_sizes or {})
        src = [p if isinstance(p, (tuple, list)) else (p,) for p in src_pattern]
        dst = [p if isinstance(p, (tuple, list)) else (p,) for p in dst_pattern]
        if len(src) != self.ndim:
            raise ValueError(f"{op}: src_pattern {src_pattern!r} has {len(src)} entries for a {self.ndim}-D tensor")
        names, sizes = [], []
        for grp, n in zip(src, self.shape):
            known = 1
            unknown = [g for g in grp if g not in fixed]
            for g in grp:
                if g in fixed:
                    known *= int(fixed[g])
            if len(unknown) > 1:
                raise ValueError(f"{op}: group {grp} has several unsized names {unknown}; give fixed_sizes")
            if unknown:
                if n % known:
                    raise ValueError(f"{op}: dim of size {n} is not divisible by {known} for group {grp}")
                fixed[unknown[0]] = n // known
            elif known != n:
                raise ValueError(f"{op}: group {grp} has size {known} but the dim has size {n}")
            for g in grp:
                if g in names:
                    raise ValueError(f"{op}: name {g!r} appears twice in src_pattern")
                names.append(g)
                sizes.append(int(fixed[g]))
        flat_dst = [g for grp in dst for g in grp]
        if sorted(flat_dst) != sorted(names):
            raise ValueError(f"{op}: dst_pattern {dst_pattern!r} must use exactly the names of src_pattern {names}")
        split = self.reshape(sizes) if list(sizes) != list(self.shape) else self
        perm = [names.index(g) for g in flat_dst]
        moved = split.permute(perm) if perm != list(range(len(perm))) else split
        out_shape = [int(np.prod([fixed[g] for g in grp])) for grp in dst]
        return moved.reshape(out_shape) if out_shape != list(moved.shape) else moved

    def indirect_(self, *a, **k):   # pragma: no cover
        raise NkiValidationError("NkiTensor.indirect: tensor indirection is NeuronCore-v4 only (not trn2)")

    # ---- access patterns (ref §3.3, SDK-AP) ------------------------------------------------
    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        op = "ap"
        st = self.storage
        if st.shared:
            raise NkiValidationError(
                f"{op}: {self.describe()} is nl.shared_identity_matrix's constant; SDK-NL: \"The compiler will reuse "
                f"all the identity matrices of the same dtype in the graph\", so its storage may be larger than "
                f"[n, n] and a raw access pattern would address other elements (partition step = the storage's row, "
                f"SDK-AP). Load it into a tile of your own (shared_identity_matrix(n, dtype, dst=tile)) and "
                f"address that, or use view indexing")
        dt = self.dtype if dtype is None else dtypes.normalize(dtype, "ap dtype")
        isz = _ITEMSIZE[dt]
        try:
            pattern = [[p[0], p[1]] if type(p[0]) is int and type(p[1]) is int else [int(p[0]), int(p[1])]
                       for p in pattern]
        except (TypeError, IndexError, ValueError):
            raise TypeError(f"{op}: pattern must be a list of [step, num] pairs, got {pattern!r}") from None
        if not pattern:
            raise ValueError(f"{op}: empty pattern")
        if offset is None:
            boff = self.boffset
            if boff % isz:
                raise NkiValidationError(f"{op}: inherited byte offset {boff} is not a multiple of {dt} size {isz}")
        else:
            if not isinstance(offset, (int, np.integer)):
                raise TypeError(f"{op}: offset must be a Python int (runtime offsets use scalar_offset=), "
                                f"got {type(offset).__name__}")
            boff = int(offset) * isz
        int32.check_ints([x for p in pattern for x in p], f"{op}: pattern (flattened [step, num] pairs)")
        if offset is not None:
            int32.check(int(offset), f"{op}: offset")
        shape = [n for _, n in pattern]
        bstrides = [s * isz for s, _ in pattern]
        for s, n in pattern:
            if n < 1:
                raise ValueError(f"{op}: pattern count must be >= 1, got {pattern}")
        if st.kind in ON_CHIP:
            row_elems = st.row_bytes // isz if st.row_bytes % isz == 0 else None
            if row_elems is None:
                raise NkiValidationError(f"{op}: partition row of {st.describe()} ({st.row_bytes} B) is not a "
                                         f"whole number of {dt} elements")
            if len(pattern) < 2:
                raise NkiValidationError(f"{op}: an on-chip access pattern needs [partition, free...] pairs, "
                                         f"got {pattern}")
            if pattern[0][1] > 1 and pattern[0][0] != row_elems:
                raise NkiValidationError(
                    f"{op}: partition step of an SBUF/PSUM access pattern must equal the free size of the "
                    f"storage ({row_elems} {dt} elements per partition of {st.describe()}), got "
                    f"{pattern[0][0]} (partition striding is illegal, SDK-AP)")
            if len(pattern) - 1 > hw.AP_MAX_FREE_DIMS:
                raise NkiValidationError(f"{op}: {len(pattern) - 1} free dims, engines support at most "
                                         f"{hw.AP_MAX_FREE_DIMS} (SDK-ARCH)")
            for s, n in pattern[1:]:
                if n > hw.AP_MAX_DIM_SIZE or abs(s) > hw.AP_MAX_STRIDE:
                    raise NkiValidationError(f"{op}: free-dim pair [{s}, {n}] exceeds the hardware AP "
                                             f"limits (size <= {hw.AP_MAX_DIM_SIZE}, |step| <= "
                                             f"{hw.AP_MAX_STRIDE}) (SDK-ARCH)")
        if scalar_offset is not None and vector_offset is not None:
            raise NkiValidationError(f"{op}: vector_offset and scalar_offset are mutually exclusive (SDK-ISA dma_copy)")
        ind = None
        if st.nbytes % isz:
            raise NkiValidationError(f"{op}: {st.describe()} is not a whole number of {dt} elements")
        if vector_offset is not None or scalar_offset is not None:
            base_shape = list(st.shape)
            if dt != st.dtype:      # strides of the base measured in the new dtype (last dim rescaled)
                base_shape[-1] = base_shape[-1] * dtypes.itemsize(st.dtype) // isz
            unit_elems = math.prod(base_shape[indirect_dim + 1:]) if base_shape else 1
        if vector_offset is not None:
            if indirect_dim != 0:
                raise NkiValidationError(f"{op}: vector_offset supports only indirect_dim=0, got {indirect_dim}")
            if not isinstance(vector_offset, NkiTensor) or vector_offset.storage.kind != SBUF:   # SDK-AP: SBUF
                raise NkiValidationError(f"{op}: vector_offset must be an SBUF tensor (P, 1), got {vector_offset!r}")
            # shape rules depend on the consumer: dma_copy needs (rows, 1), dma_transpose (16..128, n)
            if not dtypes.is_int(vector_offset.dtype):
                raise NkiValidationError(f"{op}: vector_offset dtype must be an integer type, got {vector_offset.dtype}")
            ind = Indirect("vector", vector_offset, 0, unit_elems * isz)
            bstrides[0] = 0     # the leading step is replaced by the base row size (SDK-AP)
        elif scalar_offset is not None:
            from .registers import VirtualRegister
            if isinstance(scalar_offset, NkiTensor):
                if scalar_offset.size != 1 or scalar_offset.storage.kind != SBUF:    # SDK-AP: SBUF (1, 1)
                    raise NkiValidationError(f"{op}: scalar_offset tensor must be a (1, 1) SBUF tensor, got "
                                             f"{scalar_offset.describe()}")
            elif not isinstance(scalar_offset, VirtualRegister):
                raise TypeError(f"{op}: scalar_offset must be a VirtualRegister or a (1, 1) SBUF tensor, got "
                                f"{type(scalar_offset).__name__}")
            if not 0 <= indirect_dim < max(len(st.shape), 1):
                raise NkiValidationError(f"{op}: indirect_dim {indirect_dim} out of range for base shape {list(st.shape)}")
            ind = Indirect("scalar", scalar_offset, indirect_dim, unit_elems * isz)
        v = NkiTensor._fast(st, dt, tuple(shape), tuple(bstrides), boff)
        v.indirect = ind
        if ind is None:
            v._check_bounds(op)
        return v


# ---------------------------------------------------------------------------------------------
# raw access (used by the instruction implementations)
# ---------------------------------------------------------------------------------------------

def dyn_offset(v):
    """Byte offset of a view whose start moves at run time (``.ap(scalar_offset=...)`` / ``select(dim, t)``),
    checked against the tensor (and, on-chip, against its partition rows)."""
    ind = v.indirect
    idx = ind.index
    st = v.storage
    if isinstance(idx, NkiTensor):
        check_written(idx, "dynamic offset", "scalar_offset")
        materialize(idx.storage)
        val = int(np.ndarray((), dtype=dtypes.storage(idx.dtype), buffer=idx.storage.data, offset=idx.boffset))
    else:
        val = int(idx.value)
    what = f"dynamic offset {val} (dim {ind.dim}) of {st.describe()}"
    if ind.limit is not None and not 0 <= val < ind.limit:
        raise OutOfBoundsError(f"{what} is outside [0, {ind.limit})")
    off = v.boffset + val * ind.unit
    lo, hi = _extent(off, v.shape, v.bstrides, v.itemsize)
    if v.size and (lo < 0 or hi > st.nbytes):
        raise OutOfBoundsError(f"{what} moves the view to bytes [{lo}, {hi}), outside the tensor ({st.nbytes} B)")
    if st.kind in ON_CHIP and v.size:
        R = st.row_bytes
        p0 = v.boffset // R
        flo, fhi = _extent(off - p0 * R, v.shape[1:], v.bstrides[1:], v.itemsize)
        if flo < 0 or fhi > R:
            raise OutOfBoundsError(f"{what} moves the view across a partition boundary (an on-chip dynamic offset "
                                   f"may only move along the free dims)")
    return off


_STORE = {n: dtypes.storage(n) for n in dtypes.ALL}
_CSTRIDES = {}        # (shape, dtype) -> row-major byte strides
_RESHAPE = {}         # (shape, byte strides, new shape) -> numpy's no-copy reshape strides, None if impossible
_ITEMSIZE = {n: dtypes.itemsize(n) for n in dtypes.ALL}


def raw(v, boffset=None):
    """numpy view of the elements of a view (storage dtype of the view); a scalar dynamic offset is resolved.
    Direct views cache it (the storage's data array never changes)."""
    if v.storage.fresh:
        materialize(v.storage)
    if boffset is None:
        if v.indirect is None:
            a = v._np
            if a is None:
                a = v._np = np.ndarray(v.shape, dtype=_STORE[v.dtype], buffer=v.storage.data, offset=v.boffset,
                                       strides=v.bstrides)
            return a
        boffset = v.boffset if v.indirect.kind != "scalar" else dyn_offset(v)
    return np.ndarray(v.shape, dtype=_STORE[v.dtype], buffer=v.storage.data, offset=boffset,
                      strides=v.bstrides)


def mask(v, arr=None, boffset=None):
    """Per-byte view ``v.shape + (itemsize,)`` of the written mask (or of ``arr``, e.g. PSUM ``mm``)."""
    st = v.storage
    if st.fresh:
        materialize(st)
    if boffset is None:
        if v.indirect is None:
            if arr is None:
                m = v._m
                if m is None:
                    m = v._m = np.ndarray(v.shape + (v.itemsize,), dtype=np.bool_, buffer=written_array(st),
                                          offset=v.boffset, strides=v.bstrides + (1,))
                return m
            boffset = v.boffset
        else:
            boffset = v.boffset if v.indirect.kind != "scalar" else dyn_offset(v)
    return np.ndarray(tuple(v.shape) + (v.itemsize,), dtype=np.bool_, buffer=arr if arr is not None else written_array(st),
                      offset=boffset, strides=tuple(v.bstrides) + (1,))


def covers(v):
    """True if the direct view ``v`` addresses every byte of its storage exactly once (a whole-tensor write),
    False if not or unknown (conservative)."""
    c = v._cov
    if c is None:
        c = False
        st = v.storage
        if v.indirect is None and v.boffset == 0 and v.size * v.itemsize == st.nbytes:
            if v.shape == st.shape and v.bstrides == st.cstrides:
                v._cov = True
                return True
            acc = v.itemsize
            c = True
            for s, n in sorted((s, n) for s, n in zip(v.bstrides, v.shape) if n != 1):
                if s != acc:
                    c = False
                    break
                acc *= n
        v._cov = c
    return c


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def elem_mask(v, arr=None):
    """Per-element view of a per-byte mask (``written`` or PSUM ``mm``): True where every byte is set.
    (``mask(v).all(-1)`` is ~100x slower on large tiles; the fast paths are exact.)"""
    m = mask(v, arr)
    if m.all():
        return np.ones(v.shape, np.bool_)
    if not m.any():
        return np.zeros(v.shape, np.bool_)
    isz = v.itemsize
    if isz == 1:
        return m[..., 0].copy()
    pat = int.from_bytes(b"\x01" * isz, "little")
    return (m.view(_UINT[isz]) == pat)[..., 0]


def element_addresses(v, row_offsets):
    """Byte addresses of every element of an indirect (vector) view given per-row byte offsets."""
    rest = np.zeros((1,) * (v.ndim - 1), dtype=np.int64) if v.ndim > 1 else np.zeros((), np.int64)
    for d in range(1, v.ndim):
        shp = [1] * (v.ndim - 1)
        shp[d - 1] = v.shape[d]
        rest = rest + (np.arange(v.shape[d], dtype=np.int64) * v.bstrides[d]).reshape(shp)
    rows = np.asarray(row_offsets, dtype=np.int64).reshape((-1,) + (1,) * (v.ndim - 1))
    return v.boffset + rows + rest


def first_unwritten(m):
    bad = np.argwhere(~m.all(axis=-1)) if m.ndim else np.zeros((1, 0), int)
    return tuple(int(x) for x in bad[0]) if len(bad) else None


def check_written(v, op, arg, m=None):
    st = v.storage
    if st.full or st.data is None or v.size == 0:
        return
    if m is None:
        m = mask(v)
    if not m.all():
        idx = first_unwritten(m)
        n_bad = int((~m.all(axis=-1)).sum())
        raise UninitializedReadError(
            f"{op}: {arg} reads never-written memory of tensor {st.describe()}: view {v.dtype}{list(v.shape)} "
            f"element {list(idx)} (and {n_bad - 1} more of {v.size}) was never written by any instruction")
    if 2 * v.size * v.itemsize >= st.nbytes:          # cheap to test now and then; never reverts
        st.full = bool(st.written.all())
