"""DMA instructions: dma_copy (ref §5.1, SDK-ISA dma_copy, SDK-DGE)."""
import numpy as np

from .. import dtypes
from ..errors import NkiValidationError, OutOfBoundsError
from ..memory import HBM, ON_CHIP, PSUM, SBUF
from ..runtime import current
from ..tensor import NkiTensor, check_written, element_addresses, first_unwritten, raw
from ..errors import UninitializedReadError
from .common import Instruction, check_enum, geom, record, tensor
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
    row_ok = ok_el.reshape(t.shape[0], -1).all(axis=1)
    valid = np.broadcast_to(row_ok.reshape((-1,) + (1,) * (t.ndim - 1)), t.shape)
    return t, addr, valid


def _flat(st, dt):
    return np.ndarray((st.nbytes // dtypes.itemsize(dt),), dtype=dtypes.storage(dt), buffer=st.data)


def _oob(op, name, t, mode):
    if mode == OOB.error:
        raise OutOfBoundsError(f"{op}: {name} dynamic offset/index points outside {t.storage.describe()} "
                               f"(oob_mode=error)")


def dma_copy(dst, src, priority=None, oob_mode=OOB.error, dge_mode=DGE.unknown, engine=E.unknown, name=None):
    op = OP
    for nm, t in (("dst", dst), ("src", src)):
        if isinstance(t, NkiTensor) and t.buffer == PSUM:
            raise NkiValidationError(f"{op}: {nm} is in psum ({t.describe()}); DMA cannot access PSUM (reading "
                                     f"PSUM is forbidden since NKI 0.3.0): evict with nisa.tensor_copy/activation")
        tensor(op, nm, t, (SBUF,) + HBM, "DMA", allow_indirect=True)
    check_enum(op, "oob_mode", oob_mode, OOB)
    check_enum(op, "dge_mode", dge_mode, DGE)
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
    vec = [nm for nm, t in (("dst", dst), ("src", src)) if t.indirect is not None and t.indirect.kind == "vector"]
    if vec:
        if len(vec) == 2:
            raise NkiValidationError(f"{op}: only one of src/dst may use vector_offset (gather or scatter)")
        if dge_mode not in (DGE.unknown, DGE.swdge):
            raise NkiValidationError(f"{op}: vector_offset gather/scatter needs dge_mode=swdge (or unknown), "
                                     f"got {dge_mode}")
        t = dst if vec[0] == "dst" else src
        if t.buffer not in HBM:
            raise NkiValidationError(f"{op}: the tensor indexed by vector_offset ({vec[0]}) must be in HBM, "
                                     f"got {t.buffer.value}")
    if dge_mode == DGE.hwdge and src.dtype != dst.dtype:
        raise NkiValidationError(f"{op}: dge_mode=hwdge moves raw bytes and needs equal dtypes, got src {src.dtype} "
                                 f"and dst {dst.dtype} (cast on an engine or use .view())")
    if any(t.indirect is not None for t in (src, dst)) and dge_mode == DGE.none:
        raise NkiValidationError(f"{op}: dynamic addressing needs a DGE (dge_mode=swdge/hwdge/unknown), got none")
    for nm, t in (("dst", dst), ("src", src)):
        if t.buffer in ON_CHIP and t.indirect is None:
            geom(op, nm, t, start_rule=False)       # DMA is not bound by the start-partition rule
    inst = record(op, "DMA", reads=[("src", src)], writes=[("dst", dst)],
                  dge_mode=dge_mode.name, cast=src.dtype != dst.dtype)
    if inst.shape_only:
        return Instruction(op)
    _execute(op, dst, src, oob_mode)
    return Instruction(op)


def _execute(op, dst, src, oob_mode):
    s_view, s_addr, s_valid = _resolve(op, "src", src)
    if s_valid is False:
        _oob(op, "src", src, oob_mode)
        return
    d_view, d_addr, d_valid = _resolve(op, "dst", dst)
    if d_valid is False:
        _oob(op, "dst", dst, oob_mode)
        return
    for nm, t, v in (("src", src, s_valid), ("dst", dst, d_valid)):
        if v is not None and not v.all():
            _oob(op, nm, t, oob_mode)
    sst, dst_st = src.storage, dst.storage
    isz_s = src.itemsize
    # ---- read source -------------------------------------------------------------------
    if s_addr is None:
        check_written(s_view, op, "src")
        vals = raw(s_view).reshape(-1)
        valid = None
    else:
        valid = s_valid.reshape(-1)
        a = np.where(s_valid, s_addr, 0)
        if (a % isz_s).any():
            raise NkiValidationError(f"{op}: src gather addresses are not aligned to {src.dtype}")
        if sst.written is not None:
            w = sst.written[a[..., None] + np.arange(isz_s)].all(-1) | ~s_valid
            if not w.all():
                bad = first_unwritten(w[..., None])
                raise UninitializedReadError(f"{op}: src gathers never-written memory of {sst.describe()} at "
                                             f"view element {list(bad)}")
        vals = _flat(sst, src.dtype)[(a // isz_s).reshape(-1)]
    if src.dtype == dst.dtype:
        out = vals
    else:
        out = dtypes.cast(vals.astype(np.float32), dst.dtype)     # src -> fp32 -> dst (SDK-ISA)
    if d_valid is not None:
        valid = d_valid.reshape(-1) if valid is None else (valid & d_valid.reshape(-1))
    # ---- write destination -------------------------------------------------------------
    isz_d = dst.itemsize
    if d_addr is None:
        target = raw(d_view)
        from ..tensor import mask
        m = mask(d_view)
        if valid is None:
            target[...] = out.reshape(d_view.shape)
            m[...] = True
        else:
            vm = valid.reshape(d_view.shape)
            np.copyto(target, out.reshape(d_view.shape), where=vm)
            m[vm] = True
    else:
        a = d_addr.reshape(-1)
        sel = np.ones(a.shape, bool) if valid is None else valid
        a = a[sel]
        if (a % isz_d).any():
            raise NkiValidationError(f"{op}: dst scatter addresses are not aligned to {dst.dtype}")
        _flat(dst_st, dst.dtype)[a // isz_d] = out[sel]
        dst_st.written[a[:, None] + np.arange(isz_d)] = True
    dst_st.dirty = True
