"""DMA instructions: dma_copy, dma_transpose, dma_compute (ref §5.1, SDK-ISA, SDK-DGE)."""
import numpy as np

from .. import dtypes
from .. import hbm_order, hw
from ..errors import NkiValidationError, OutOfBoundsError, by_switch
from ..memory import HBM, ON_CHIP, PSUM, SBUF, materialize, written_array
from ..site import current
from ..tensor import NkiTensor, check_written, covers, element_addresses, first_unwritten, raw
from ..errors import UninitializedReadError
from .common import Instruction, check_enum, geom, mark, record, tensor
from .enums import dge_mode as DGE, engine as E, oob_mode as OOB

OP = "dma_copy"


def _index_value(op, name, idx):
    from ..registers import VirtualRegister
    if isinstance(idx, VirtualRegister):
        return int(idx.value)
    a = raw(idx)
    check_written(idx, op, f"{name} scalar_offset")
    return int(a.reshape(-1)[0])


def _resolve(op, name, t):
    """-> (addresses int64 array shaped t.shape (byte addresses) or None for direct,
           per-element validity bool array or None, possibly rebased direct view)."""
    ind = t.indirect
    if ind is None:
        return t, None, None
    st = t.storage
    isz = t.itemsize
    if ind.kind == "scalar":
        v = _index_value(op, name, ind.index)
        if ind.limit is not None and not 0 <= v < ind.limit:
            return t, None, False
        base = NkiTensor(st, t.dtype, t.shape, t.bstrides, t.boffset + v * ind.unit)
        from ..tensor import _extent
        lo, hi = _extent(base.boffset, base.shape, base.bstrides, isz)
        if lo < 0 or hi > st.nbytes:
            return base, None, False
        return base, None, None
    idx = raw(ind.index).reshape(-1).astype(np.int64)
    check_written(ind.index, op, f"{name} vector_offset")
    addr = element_addresses(t, idx * ind.unit)
    ok_el = (addr >= 0) & (addr + isz <= st.nbytes)
    if ind.limit is not None:
        ok_el &= ((idx >= 0) & (idx < ind.limit)).reshape((-1,) + (1,) * (t.ndim - 1))
    row_ok = ok_el.reshape(t.shape[0], -1).all(axis=1)
    valid = np.broadcast_to(row_ok.reshape((-1,) + (1,) * (t.ndim - 1)), t.shape)
    return t, addr, valid


def _flat(st, dt):
    materialize(st)
    return np.ndarray((st.nbytes // dtypes.itemsize(dt),), dtype=dtypes.storage(dt), buffer=st.data)


def _oob(op, name, t, mode):
    if mode == OOB.error:
        raise OutOfBoundsError(f"{op}: {name} dynamic offset/index points outside {t.storage.describe()} "
                               f"(oob_mode=error)")


def run_bytes(t):
    """Bytes of the longest contiguous run at the innermost end of a view's access pattern, within one partition
    row for on-chip tensors (what one DMA descriptor moves; traced as ``run_bytes``, the smaller of src and dst).
    Dims of size 1 are skipped; a dynamic (indirect) view counts its static pattern."""
    run = t.itemsize
    dims = range(len(t.shape) - 1, 0 if t.storage.onchip else -1, -1)
    for d in dims:
        n = t.shape[d]
        if n == 1:
            continue
        if t.bstrides[d] != run:
            break
        run *= n
    return run


def _view_addresses(v):
    """Byte address of every element of a direct view, shaped like it."""
    a = np.full(tuple(v.shape), v.boffset, dtype=np.int64)
    for d in range(v.ndim):
        shp = [1] * v.ndim
        shp[d] = v.shape[d]
        a = a + (np.arange(v.shape[d], dtype=np.int64) * v.bstrides[d]).reshape(shp)
    return a


def _partition_fold(op, src, dst):
    by_switch(hw.DMA_SBUF_PARTITION_FOLD,
              f"{op}: SBUF -> SBUF copy from {src.shape[0]} partitions ({src.describe()}) to {dst.shape[0]} "
              f"({dst.describe()}): trn2-costs 'Pitfalls met on real hardware': dma_copy needs equal partition counts "
              f"src/dst, SBUF access patterns cannot fold partitions into a row; go through HBM or transpose on the "
              f"PE (switch: nkisim.hw.DMA_SBUF_PARTITION_FOLD)")


def dma_copy(dst, src, priority=None, oob_mode=OOB.error, dge_mode=DGE.unknown, engine=E.unknown, name=None):
    op = OP
    for nm, t in (("dst", dst), ("src", src)):
        if isinstance(t, NkiTensor) and t.buffer == PSUM:
            raise NkiValidationError(f"{op}: {nm} is in psum ({t.describe()}); DMA cannot access PSUM (SDK-ISA "
                                     f"dma_copy: src and dst can be in HBM or SBUF; reading PSUM is forbidden since "
                                     f"NKI 0.3.0): " + ("evict with nisa.tensor_copy/activation" if nm == "src" else
                                                        "DMA into SBUF, then write PSUM with an engine"))
        tensor(op, nm, t, (SBUF,) + HBM, "DMA", allow_indirect=True)
    check_enum(op, "oob_mode", oob_mode, OOB)
    dge_mode = check_enum(op, "dge_mode", dge_mode, DGE)
    check_enum(op, "engine", engine, E)
    if priority is not None:
        raise NkiValidationError(f"{op}: priority= is NeuronCore-v4 only, not available on trn2")
    if engine not in (E.unknown, E.sync, E.scalar):
        raise NkiValidationError(f"{op}: engine must be engine.sync or engine.scalar (HWDGE trigger) or unknown, "
                                 f"got {engine}")
    if engine != E.unknown and dge_mode != DGE.hwdge:
        raise NkiValidationError(f"{op}: engine={engine} is only valid with dge_mode=hwdge")
    if dst.size != src.size:
        raise NkiValidationError(f"{op}: src {src.describe()} has {src.size} elements but dst {dst.describe()} has "
                                 f"{dst.size}; the total element counts must match")
    if dst.buffer in ON_CHIP and src.buffer in ON_CHIP and dst.shape[0] != src.shape[0]:
        _partition_fold(op, src, dst)
    vec = [nm for nm, t in (("dst", dst), ("src", src)) if t.indirect is not None and t.indirect.kind == "vector"]
    if vec:
        if len(vec) == 2:
            raise NkiValidationError(f"{op}: only one of src/dst may use vector_offset (gather or scatter)")
        if dge_mode not in (DGE.unknown, DGE.swdge):
            raise NkiValidationError(f"{op}: vector_offset gather/scatter needs dge_mode=swdge (or unknown), "
                                     f"got {dge_mode}")
        t = dst if vec[0] == "dst" else src
        vo = t.indirect.index
        if vo.shape[0] != t.shape[0] or vo.size != vo.shape[0]:
            raise NkiValidationError(f"{op}: {vec[0]} vector_offset has shape {list(vo.shape)}, expected "
                                     f"({t.shape[0]}, 1): one index per row of the access pattern")
        if t.buffer not in HBM:
            raise NkiValidationError(f"{op}: the tensor indexed by vector_offset ({vec[0]}) must be in HBM, "
                                     f"got {t.buffer.value}")
        other_name = "src" if vec[0] == "dst" else "dst"
        other = src if vec[0] == "dst" else dst
        if other.buffer in ON_CHIP and vo.buffer in ON_CHIP:
            p_other = geom(op, other_name, other, start_rule=False)[0]
            p_index = geom(op, "vector_offset", vo, start_rule=False)[0]
            if p_other != p_index:
                by_switch(hw.DMA_VECTOR_OFFSET_ALIGN,
                          f"{op}: the vector_offset index tile starts at partition {p_index} but the {other_name} it "
                          f"pairs with at partition {p_other}; vector indirection is documented with the index tile "
                          f"aligned with the partitions it addresses (SDK-ISA dma_copy \"Vector indirection\"); "
                          f"one index goes through scalar_offset (switch: nkisim.hw.DMA_VECTOR_OFFSET_ALIGN)")
    if dge_mode == DGE.hwdge and src.dtype != dst.dtype:
        raise NkiValidationError(f"{op}: dge_mode=hwdge moves raw bytes and needs equal dtypes, got src {src.dtype} "
                                 f"and dst {dst.dtype} (cast on an engine or use .view())")
    if any(t.indirect is not None for t in (src, dst)) and dge_mode == DGE.none:
        raise NkiValidationError(f"{op}: dynamic addressing needs a DGE (dge_mode=swdge/hwdge/unknown), got none")
    for nm, t in (("dst", dst), ("src", src)):
        if t.buffer in ON_CHIP and t.indirect is None:
            geom(op, nm, t, start_rule=False)       # DMA is not bound by the start-partition rule
    inst = record(op, "DMA", reads=[("src", src)], writes=[("dst", dst)],
                  dge_mode=dge_mode.name, cast=src.dtype != dst.dtype, trigger=engine.name,
                  run_bytes=min(run_bytes(src), run_bytes(dst)))
    if inst.shape_only:
        carry_known(dst, src)
        return Instruction(op)
    _execute(op, dst, src, oob_mode)
    return Instruction(op)


KNOWN_MAX_ELEMS = 1024      # shape-only: integer values a DMA may carry on chip (a few scalars, a broadcast column)


def _elements(t):
    """Flat element indices (in the storage) of a direct view, in view order."""
    rows = np.arange(t.shape[0], dtype=np.int64) * t.bstrides[0]
    return np.broadcast_to(element_addresses(t, rows), t.shape).reshape(-1) // t.itemsize


def carry_known(dst, src):
    """Shape-only mode: a DMA copying integer values from a real integer input (or from a tile that holds such
    copied values) into a small on-chip tile keeps them on the destination (``storage.known``), so that a later
    ``register_load`` of it sees them. Only copies: anything an engine computes still has no data (and any other
    write forgets the carried values, isa/common.record)."""
    if dst.indirect is not None or src.indirect is not None or not dst.storage.onchip:
        return
    if dst.size > KNOWN_MAX_ELEMS or dst.dtype not in dtypes.INTEGER or src.dtype not in dtypes.INTEGER:
        return
    st = src.storage
    if st.data is not None:
        vals = [int(v) for v in raw(src).reshape(-1)]
    elif st.known is not None:
        idx = _elements(src)
        if not all(int(i) in st.known for i in idx):
            return
        vals = [st.known[int(i)] for i in idx]
    else:
        return
    dst.storage.known = dict(zip((int(i) for i in _elements(dst)), vals))


def read_view(op, name, t, oob_mode):
    """Values of a (possibly indirect) view in row-major view order, storage dtype of ``t`` ->
    (values 1-D, per-element validity 1-D or None). Returns (None, None) when a scalar offset is out of
    bounds and oob_mode=skip (the whole transfer is skipped)."""
    view, addr, valid = _resolve(op, name, t)
    if valid is False:
        _oob(op, name, t, oob_mode)
        return None, None
    if valid is not None and not valid.all():
        _oob(op, name, t, oob_mode)
    st = t.storage
    isz = t.itemsize
    if addr is None:
        check_written(view, op, name)
        hbm_order.note(current(op), st, False, op, view=view)
        return raw(view).reshape(-1), None
    hbm_order.note(current(op), st, False, op, addr=addr[valid], itemsize=isz)
    a = np.where(valid, addr, 0)
    if (a % isz).any():
        raise NkiValidationError(f"{op}: {name} gather addresses are not aligned to {t.dtype}")
    if st.data is not None:
        w = written_array(st)[a[..., None] + np.arange(isz)].all(-1) | ~valid
        if not w.all():
            bad = first_unwritten(w[..., None])
            raise UninitializedReadError(f"{op}: {name} gathers never-written memory of {st.describe()} at "
                                         f"view element {list(bad)}")
    return _flat(st, t.dtype)[(a // isz).reshape(-1)], valid.reshape(-1)


def write_view(op, name, t, out, valid, oob_mode):
    """Store ``out`` (1-D, t's storage dtype, view order) into a (possibly indirect) view; elements whose
    ``valid`` is False are skipped."""
    view, addr, dvalid = _resolve(op, name, t)
    if dvalid is False:
        _oob(op, name, t, oob_mode)
        return
    if dvalid is not None:
        if not dvalid.all():
            _oob(op, name, t, oob_mode)
        valid = dvalid.reshape(-1) if valid is None else (valid & dvalid.reshape(-1))
    st = t.storage
    isz = t.itemsize
    if addr is None:
        hbm_order.note(current(op), st, True, op, view=view if valid is None else None,
                       addr=None if valid is None else _view_addresses(view)[valid.reshape(view.shape)],
                       itemsize=isz)
        from ..tensor import covers, mask
        if valid is None and st.fresh and covers(view):
            st.fresh = False        # overwritten entirely below: no sentinel fill needed
        target = raw(view)
        if valid is None:
            target[...] = out.reshape(view.shape)
            mark(view)
        else:
            m = mask(view)
            vm = valid.reshape(view.shape)
            np.copyto(target, out.reshape(view.shape), where=vm)
            m[vm] = True
    else:
        a = addr.reshape(-1)
        sel = np.ones(a.shape, bool) if valid is None else valid
        a = a[sel]
        hbm_order.note(current(op), st, True, op, addr=a, itemsize=isz)
        if (a % isz).any():
            raise NkiValidationError(f"{op}: {name} scatter addresses are not aligned to {t.dtype}")
        _flat(st, t.dtype)[a // isz] = out[sel]
        written_array(st)[a[:, None] + np.arange(isz)] = True
    st.dirty = True


def _same_bytes(a, b):
    """Two direct views naming exactly the same bytes in the same order (a DMA self-copy)."""
    if a.storage is not b.storage or a.dtype != b.dtype or a.shape != b.shape:
        return False
    ra, rb = raw(a), raw(b)
    return ra.__array_interface__["data"][0] == rb.__array_interface__["data"][0] and ra.strides == rb.strides


def _execute(op, dst, src, oob_mode):
    if src.indirect is None and dst.indirect is None:
        if _same_bytes(src, dst):
            # A self-copy (nkilib dynamic_elementwise_add's "HBM fence", dma_copy(dst=t, src=t)) moves every byte
            # onto itself: DMA moves raw bytes without interpreting them (SDK nki-0-3-0-update-guide, dma_copy
            # dge_mode), so bytes no instruction wrote stay as they were -- not a read of uninitialized data.
            return
        # direct views (the common case): the same steps as read_view/write_view without their generality
        inst = current(op)
        hbm_order.note(inst, src.storage, False, op, view=src)
        hbm_order.note(inst, dst.storage, True, op, view=dst)
        sst = src.storage
        if not sst.full:
            check_written(src, op, "src")
        vals = raw(src)
        if src.dtype != dst.dtype:
            vals = dtypes.cast(vals.astype(np.float32), dst.dtype)     # src -> fp32 -> dst (SDK-ISA)
        if vals.shape != dst.shape:
            vals = vals.reshape(-1).reshape(dst.shape)
        dstg = dst.storage
        if dstg.fresh and covers(dst):
            dstg.fresh = False          # overwritten entirely below: no sentinel fill needed
        raw(dst)[...] = vals
        mark(dst)
        return
    vals, valid = read_view(op, "src", src, oob_mode)
    if vals is None:
        return
    if src.dtype == dst.dtype:
        out = vals
    else:
        out = dtypes.cast(vals.astype(np.float32), dst.dtype)     # src -> fp32 -> dst (SDK-ISA)
    write_view(op, "dst", dst, out, valid, oob_mode)


# ---- dma_transpose (ref §5.1, SDK-ISA) --------------------------------------------------------
_DMA_T_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=DGE.unknown, oob_mode=OOB.error, name=None):
    """Bit-exact permutation by the DMA: 2-D ``(1, 0)``, 3-D ``(2, 1, 0)``, 4-D ``(3, 1, 2, 0)``. dst in SBUF, src
    in HBM or SBUF, equal 2-byte dtypes. With ``src.ap(..., vector_offset=indices)`` (SW-DGE gather-transpose,
    trn2+): ``flat = indices.T.flatten()[:rows]; dst = transpose(src_rows[flat])`` (SDK-ISA)."""
    op = "dma_transpose"
    tensor(op, "dst", dst, (SBUF,), "DMA")
    tensor(op, "src", src, (SBUF,) + HBM, "DMA", allow_indirect=True)
    dge_mode = check_enum(op, "dge_mode", dge_mode, DGE)
    check_enum(op, "oob_mode", oob_mode, OOB)
    if priority is not None:
        raise NkiValidationError(f"{op}: priority= is NeuronCore-v4 only, not available on trn2")
    if src.dtype != dst.dtype:
        raise NkiValidationError(f"{op}: src dtype {src.dtype} must equal dst dtype {dst.dtype}")
    if src.itemsize != 2:
        raise NkiValidationError(f"{op}: dtype {src.dtype} is {src.itemsize} bytes; dma_transpose needs a 2-byte "
                                 f"dtype (SDK-ISA)")
    r = src.ndim
    if r not in _DMA_T_AXES:
        raise NkiValidationError(f"{op}: src is {r}-D; dma_transpose supports 2-D, 3-D and 4-D tiles")
    perm = _DMA_T_AXES[r]
    if axes is not None and tuple(axes) != perm:
        raise NkiValidationError(f"{op}: axes={tuple(axes)} for a {r}-D src; the supported permutation is {perm} "
                                 f"(SDK-ISA: (1, 0), (2, 1, 0), (3, 1, 2, 0))")
    want = tuple(src.shape[a] for a in perm)
    if tuple(dst.shape) != want:
        raise NkiValidationError(f"{op}: dst is {list(dst.shape)}, expected {list(want)} (src {list(src.shape)} "
                                 f"permuted by {perm}; dst rank must equal src rank since NKI 0.4.0)")
    geom(op, "dst", dst, start_rule=False)
    ind = src.indirect
    extra = {}
    if ind is None:
        if dge_mode not in (DGE.unknown, DGE.hwdge):
            raise NkiValidationError(f"{op}: dge_mode={dge_mode.name} is not valid for a direct DMA transpose; "
                                     f"expected unknown or hwdge (SDK-ISA)")
        if oob_mode != OOB.error:
            raise NkiValidationError(f"{op}: oob_mode=skip is only valid when src uses indirect indexing")
        if src.buffer in (SBUF,):
            geom(op, "src", src, start_rule=False)
        if dge_mode == DGE.hwdge:      # HW-DGE direct transpose constraints, NKI 0.6.0 (ref §5.1)
            s0 = src.shape[0]
            if r == 2 and s0 != 16:
                raise NkiValidationError(f"{op}: dge_mode=hwdge 2-D transpose needs src.shape[0] == 16, got {s0}")
            if r > 2 and (s0 not in (1, 2, 4, 8, 16) or (s0 * src.shape[-2]) % 16):
                raise NkiValidationError(f"{op}: dge_mode=hwdge {r}-D transpose needs src.shape[0] in (1, 2, 4, 8, 16) "
                                         f"and src.shape[0] * src.shape[-2] % 16 == 0, got shape {list(src.shape)}")
            if src.shape[-1] > 128:
                raise NkiValidationError(f"{op}: dge_mode=hwdge needs src.shape[-1] <= 128, got {src.shape[-1]}")
    else:
        if ind.kind != "vector":
            raise NkiValidationError(f"{op}: src uses scalar_offset; dma_transpose supports only vector_offset "
                                     f"(gather-transpose) indirection")
        if dge_mode not in (DGE.unknown, DGE.swdge):
            raise NkiValidationError(f"{op}: an indirect (gather) transpose is lowered to SW-DGE; dge_mode must be "
                                     f"unknown or swdge, got {dge_mode.name}")
        idx = ind.index
        rows = src.shape[0]
        checks = [
            (src.buffer in HBM, f"src must be in HBM, got {src.buffer.value}"),
            (r != 4 or src.shape[1] == 1 or src.shape[2] == 1, f"4-D src needs shape[1] or shape[2] == 1, got {list(src.shape)}"),
            (src.shape[-1] <= 128, f"src.shape[-1] must be <= 128, got {src.shape[-1]}"),
            (idx.ndim == 2, f"indices must be 2-D, got {list(idx.shape)}"),
            (idx.dtype == "uint32", f"indices must be uint32, got {idx.dtype}"),
            (idx.buffer == SBUF, f"indices must be in SBUF, got {idx.buffer.value}"),
            (rows % 16 == 0, f"src.shape[0] must be divisible by 16, got {rows}"),
        ]
        if idx.ndim == 2:
            checks += [
                (idx.shape[0] * idx.shape[1] >= rows, f"indices {list(idx.shape)} hold fewer than src.shape[0]={rows} indices"),
                (16 <= idx.shape[0] <= 128 and idx.shape[0] % 16 == 0, f"indices.shape[0] must be in [16, 128] and divisible by 16, got {idx.shape[0]}"),
                (idx.shape[1] == 1 or idx.shape[0] == 128, f"indices.shape[0] must be 128 when indices.shape[1] > 1, got {list(idx.shape)}"),
            ]
        for ok, msg in checks:
            if not ok:
                raise NkiValidationError(f"{op}: indirect transpose: {msg} (SDK-ISA)")
        extra["indirect"] = True
    inst = record(op, "DMA", reads=[("src", src)], writes=[("dst", dst)], dge_mode=dge_mode.name, axes=list(perm),
                  **extra)
    if inst.shape_only:
        return Instruction(op)
    if ind is None:
        check_written(src, op, "src")
        vals = raw(src)
        from .common import write
        write(dst, np.ascontiguousarray(np.transpose(vals, perm)), exact=True)
        return Instruction(op)
    check_written(ind.index, op, "indices")
    flat = raw(ind.index).T.reshape(-1)[:src.shape[0]].astype(np.int64)
    addr = element_addresses(src, flat * ind.unit)
    st = src.storage
    ok = ((addr >= 0) & (addr + 2 <= st.nbytes)).reshape(src.shape[0], -1).all(axis=1)
    if not ok.all():
        _oob(op, "src", src, oob_mode)
    valid = np.broadcast_to(ok.reshape((-1,) + (1,) * (src.ndim - 1)), src.shape)
    a = np.where(valid, addr, 0)
    if st.data is not None:
        w = written_array(st)[a[..., None] + np.arange(2)].all(-1) | ~valid
        if not w.all():
            raise UninitializedReadError(f"{op}: src gathers never-written memory of {st.describe()} at view element "
                                         f"{list(first_unwritten(w[..., None]))}")
    vals = _flat(st, src.dtype)[a // 2]
    out = np.transpose(vals, perm)
    keep = np.transpose(valid, perm)
    target = raw(dst)
    np.copyto(target, out, where=keep)
    from ..tensor import mask
    mask(dst)[keep] = True
    dst.storage.dirty = True
    return Instruction(op)


# ---- dma_compute (ref §5.1, SDK-ISA) ----------------------------------------------------------
DMA_COMPUTE_MAX_SRCS = 16


def _same_view(a, b):
    return (a.storage is b.storage and a.shape == b.shape and a.bstrides == b.bstrides and a.boffset == b.boffset
            and a.dtype == b.dtype)


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=OOB.error, name=None):
    """``dst = srcs[0] + srcs[1] + ...`` computed by the DMA engines in fp32 (only ``nl.add``, all scales 1.0,
    at most 16 sources, equal element counts), plus the two read-modify-write forms with a ``vector_offset``:
    scatter ``dst(HBM)[idx] += src(SBUF)`` and gather ``dst(SBUF) += src(HBM)[idx]`` (SDK-ISA dma_compute)."""
    op = "dma_compute"
    from .. import ops as _ops
    if _ops.get(reduce_op, op, "reduce_op", reduction=True).name != "add":
        raise NkiValidationError(f"{op}: reduce_op must be nl.add (the only supported operation), got {reduce_op!r}")
    check_enum(op, "oob_mode", oob_mode, OOB)
    if not isinstance(srcs, (list, tuple)) or not srcs:
        raise TypeError(f"{op}: srcs must be a non-empty list of tensors, got {srcs!r}")
    srcs = list(srcs)
    if len(srcs) > DMA_COMPUTE_MAX_SRCS:
        raise NkiValidationError(f"{op}: {len(srcs)} sources, at most {DMA_COMPUTE_MAX_SRCS}")
    if scales is not None:
        if len(scales) != len(srcs) or any(float(x) != 1.0 for x in scales):
            raise NkiValidationError(f"{op}: scales must be None or one 1.0 per source (other scales are not "
                                     f"supported yet), got {scales!r}")
    for nm, t in [("dst", dst)] + [(f"srcs[{i}]", t) for i, t in enumerate(srcs)]:
        if isinstance(t, NkiTensor) and t.buffer == PSUM:
            raise NkiValidationError(f"{op}: {nm} is in psum; DMA engines cannot access PSUM")
        tensor(op, nm, t, (SBUF,) + HBM, "DMA", allow_indirect=True)
        if t.indirect is not None and t.indirect.kind != "vector":
            raise NkiValidationError(f"{op}: {nm} uses scalar_offset; dma_compute needs compile-time addresses "
                                     f"except for vector_offset read-modify-write")
        if t.size != dst.size:
            raise NkiValidationError(f"{op}: {nm} has {t.size} elements, dst has {dst.size}; element counts must match")
    vec = [i for i, t in enumerate(srcs) if t.indirect is not None]
    mode = "elementwise"
    if dst.indirect is not None or vec:
        if len(srcs) != 2:
            raise NkiValidationError(f"{op}: read-modify-write with vector_offset needs exactly 2 sources, got {len(srcs)}")
        if not unique_indices:
            raise NkiValidationError(f"{op}: unique_indices=False (non-unique scatter indices) is not supported yet")
        if dst.indirect is not None:       # scatter RMW: dst(HBM)[idx] = dst[idx] + src(SB)
            m = [i for i, t in enumerate(srcs) if t.indirect is not None and _same_view(t, dst)
                 and t.indirect.index is dst.indirect.index]
            if dst.buffer not in HBM or len(m) != 1 or srcs[1 - m[0]].buffer != SBUF or srcs[1 - m[0]].indirect:
                raise NkiValidationError(f"{op}: scatter read-modify-write needs dst in HBM with vector_offset, one "
                                         f"source equal to dst (same .ap and indices) and the other in SBUF")
            mode = "scatter_rmw"
        else:                              # gather RMW: dst(SB) = dst + src(HBM)[idx]
            if dst.buffer != SBUF or len(vec) != 1 or srcs[vec[0]].buffer not in HBM or \
                    not _same_view(srcs[1 - vec[0]], dst):
                raise NkiValidationError(f"{op}: gather read-modify-write needs dst in SBUF, one source in HBM with "
                                         f"vector_offset and the other source equal to dst")
            mode = "gather_rmw"
        for t in [dst] + srcs:
            if t.indirect is not None:
                vo = t.indirect.index
                if vo.shape[0] != t.shape[0] or vo.size != vo.shape[0]:
                    raise NkiValidationError(f"{op}: vector_offset has shape {list(vo.shape)}, expected "
                                             f"({t.shape[0]}, 1)")
    for nm, t in [("dst", dst)] + [(f"srcs[{i}]", t) for i, t in enumerate(srcs)]:
        if t.buffer == SBUF and t.indirect is None:
            geom(op, nm, t, start_rule=False)
    inst = record(op, "DMA", reads=[(f"srcs[{i}]", t) for i, t in enumerate(srcs)], writes=[("dst", dst)],
                  reduce_op="add", mode=mode, n_srcs=len(srcs))
    if inst.shape_only:
        return Instruction(op)
    acc, valid = None, None
    for i, t in enumerate(srcs):
        v, ok = read_view(op, f"srcs[{i}]", t, oob_mode)
        if v is None:
            return Instruction(op)
        v = v.astype(np.float32)
        acc = v if acc is None else (acc + v).astype(np.float32)
        if ok is not None:
            valid = ok if valid is None else valid & ok
    out = dtypes.cast(acc, dst.dtype)
    write_view(op, "dst", dst, out, valid, oob_mode)
    return Instruction(op)
