"""``nki.collectives`` (SDK-CC, NKI 0.6.0): collectives across the ranks of an ``nkisim.launch``.

Model (ref §5.10; sources cited inline):

* A **rank** is a logical NeuronCore (``nkisim.launch(..., tp=4, lnc=2)`` = 4 ranks x 2 physical cores,
  SDK-LNC). ``ReplicaGroup([[...], ...])`` lists rank ids; each rank takes part in the one rank-list
  that contains it, the rank-lists run independently (SDK-CC ReplicaGroup docstring: sub-groups must
  not overlap).
* Under LNC=2 **each physical core issues its own collective**, with its own SBUF buffers, and core c
  of a rank meets core c of the other ranks of its rank-list. Evidence: aws-neuron/nki-library
  ``experimental/collectives/sb2sb_allgather.py`` (``allgather_sb2sb_tiled``: under ``kernel[lnc]`` every
  core all-gathers its own M tiles over ``ReplicaGroup([range(tp)])``) and KevGomes1403/nki-moe-megakernel
  ``nki_kernels/megakernel/collectives.py`` (both cores all-reduce their own SBUF partial, then exchange
  halves with ``sendrecv``). The two cores of one rank talk through ``nisa.sendrecv`` / ``core_barrier``.
* Calls are matched per (core, rank-list) in **issue order**; every member must issue the same kind of
  collective with matching dtypes/shapes, otherwise the launch fails naming both sides.
* **Determinism**: reductions are computed in fp32 (integers exactly) folding the members in
  ascending rank id, then rounded once to the dst dtype (RNE) -- every member gets the same bits, and
  repeated runs give the same bits. The real CC-core reduction order/precision is not documented
  (inference; ref §12). Gathers/scatters place chunks by the member's position in its rank-list.
* A collective blocks its caller until every member has issued it (instances switch only at such
  synchronisation points, see runtime.py). A member that finishes, or waits elsewhere, without
  issuing it makes the launch fail with a message naming the collective and the missing ranks.
* Trace: one record per participating instance, ``engine="CC"``, with a ``collective`` dict (kind, id
  shared by all participants, rank-list, participants [[rank, core], ...], payload bytes) for a cost
  model (fixed latency + bytes / bandwidth, trn2-costs.md "TP all-reduce ... 13.3 us").
"""
import sys
from dataclasses import dataclass, field

import numpy as np

from .runtime import QUIET

from . import dtypes, frontend, ops
from .errors import NkiValidationError, OutOfBoundsError, UninitializedReadError
from .isa.common import Instruction, read_raw, record, write
from .language import NKIObject
from .memory import HBM, PRIVATE_HBM, PSUM, SBUF, SHARED_HBM
from .registers import VirtualRegister
from .site import current
from .tensor import NkiTensor, check_written, mask, raw

F32 = np.float32
_REDUCE_OPS = ("add", "minimum", "maximum")       # SDK-CC all_reduce / reduce_scatter: nl.add, nl.minimum, nl.maximum


@dataclass
class ReplicaGroup(NKIObject):
    """The rank-lists a collective runs on, e.g. ``ReplicaGroup([[0, 1, 2, 3]])`` (SDK-CC; NKL tests use
    ``ReplicaGroup([list(range(tp))])``). Sub-groups must not overlap.

    Its fields are not part of the public interface (SDK-CC documents none; ../shared/docs/nki-api-0.6.json): kernel
    code reading ``.groups`` during a launch is refused (frontend.attribute_guard); nkisim and host code may."""
    groups: list = field(default_factory=list)

    def __getattribute__(self, name):
        if name == "groups":
            frontend.attribute_guard(self, name, ())
        return object.__getattribute__(self, name)


# ---- validation helpers ----------------------------------------------------------------------
def _ctx(op):
    inst = current(f"ncc.{op}")
    if not inst.world.comms:
        raise NkiValidationError(
            f"ncc.{op}: collectives need a multi-rank launch with initialised communicators: "
            f"nkisim.launch(kernel, per_rank_args, tp=..., lnc=...). A single-process launch "
            f"(kernel(...) / kernel[2](...)) has none, and on trn2 such a NEFF fails to load (trn2-costs.md: "
            f"'rg=None must skip every TP collective at TP=1')")
    return inst


def _priority(op, priority):
    if priority is not None:
        raise NkiValidationError(f"ncc.{op}: priority= (DMA QoS) is NeuronCore-v4+ only, not available on trn2; "
                                 f"got priority={priority!r}, expected None")


def _rank_list(op, replica_group, inst):
    if not isinstance(replica_group, ReplicaGroup):
        raise TypeError(f"ncc.{op}: replica_group must be an nki.collectives.ReplicaGroup, got "
                        f"{type(replica_group).__name__}")
    tp = inst.world.tp
    try:
        groups = [[int(r) for r in g] for g in replica_group.groups]
    except TypeError:
        raise TypeError(f"ncc.{op}: ReplicaGroup must hold a list of rank lists, got {replica_group.groups!r}") from None
    seen = {}
    for g in groups:
        if not g:
            raise NkiValidationError(f"ncc.{op}: replica group {groups} has an empty rank list")
        for r in g:
            if not 0 <= r < tp:
                raise NkiValidationError(f"ncc.{op}: replica group {groups} names rank {r}, but the launch has ranks "
                                         f"0..{tp - 1} (tp={tp})")
            if r in seen:
                raise NkiValidationError(f"ncc.{op}: replica group {groups}: rank {r} appears in more than one place; "
                                         f"rank lists must not overlap (SDK-CC ReplicaGroup)")
            seen[r] = True
    mine = [g for g in groups if inst.rank in g]
    if not mine:
        raise NkiValidationError(f"ncc.{op}: rank {inst.rank} issued a collective on replica group {groups} that does "
                                 f"not contain it")
    return groups, tuple(mine[0])


def _tlist(op, name, x, n=None):
    if not isinstance(x, (list, tuple)):
        raise TypeError(f"ncc.{op}: {name} must be a list of tensors, got {type(x).__name__}")
    if not x:
        raise NkiValidationError(f"ncc.{op}: {name} is empty")
    for i, t in enumerate(x):
        if not isinstance(t, NkiTensor):
            raise TypeError(f"ncc.{op}: {name}[{i}] must be a tensor, got {type(t).__name__}")
        if t.indirect is not None:
            raise NkiValidationError(f"ncc.{op}: {name}[{i}] has a dynamic access pattern; collectives take direct "
                                     f"tensor views")
    if n is not None and len(x) != n:
        raise NkiValidationError(f"ncc.{op}: {name} has {len(x)} tensors, expected exactly {n}")
    return list(x)


def _memory(op, srcs, dsts, hbm_only=False, per_channel=False):
    """All HBM or all SBUF (SDK-CC); coalescing (several tensors) only on HBM. Returns 'hbm' or 'sbuf'."""
    named = [("srcs", i, t) for i, t in enumerate(srcs)] + [("dsts", i, t) for i, t in enumerate(dsts)]
    for nm, i, t in named:
        if t.buffer == PSUM:
            raise NkiValidationError(f"ncc.{op}: {nm}[{i}] {t.describe()} is in psum; collective tensors live in HBM "
                                     f"or SBUF (SDK-CC)")
    kinds = {"hbm" if t.buffer in HBM else "sbuf" for _, _, t in named}
    if len(kinds) > 1:
        raise NkiValidationError(f"ncc.{op}: tensors mix HBM and SBUF ({', '.join(f'{nm}[{i}] in {t.buffer.value}' for nm, i, t in named)}); "
                                 f"all must be on HBM or all on SBUF (SDK-CC)")
    kind = kinds.pop()
    if hbm_only and kind != "hbm":
        raise NkiValidationError(f"ncc.{op}: tensors must reside on HBM; SBUF is not supported for {op} (SDK-CC)")
    if kind == "sbuf":
        if not per_channel and (len(srcs) > 1 or len(dsts) > 1):
            raise NkiValidationError(f"ncc.{op}: {len(srcs)} srcs / {len(dsts)} dsts on SBUF; coalesced collectives "
                                     f"(several tensors) are only supported on HBM (SDK-CC)")
        for nm, i, t in named:
            if t.ndim != 2:
                raise NkiValidationError(f"ncc.{op}: {nm}[{i}] {t.describe()} is {t.ndim}-D; SBUF collectives operate "
                                         f"on 2-D tensors with a single free dimension (SDK-CC all_gather)")
            if not t.is_contiguous():
                # MK nki_kernels/megakernel/collectives.py: "nccl SBUF all_reduce needs a densely packed operand"
                raise NkiValidationError(f"ncc.{op}: {nm}[{i}] view {t.describe()} is not densely packed (its "
                                         f"partition stride is not its free size); SBUF collectives need a dense "
                                         f"operand: tensor_copy the block into its own tile first")
    else:
        for nm, i, t in named:
            st = t.storage
            if st.is_input:
                raise NkiValidationError(
                    f"ncc.{op}: {nm}[{i}] {t.describe()} is a kernel argument; collective instructions cannot "
                    f"read/write kernel I/O tensors (aws-neuron/nki-library test_collectives.py): dma_copy it into "
                    f"an nl.shared_hbm tensor first")
            if not st.named:
                raise NkiValidationError(
                    f"ncc.{op}: HBM {nm}[{i}] {t.describe()} was allocated without name=; the compiler needs named "
                    f"collective HBM tensors (NCC_IBIR440 DRAM allocation failure, aws-neuron/nki-library "
                    f"test_collectives.py): nl.ndarray(..., buffer=nl.shared_hbm, name='...')")
    for _, _, t in named:
        t.storage.cc = True
    return kind


def _same_dtype(op, a_name, a, b_name, b):
    if a.dtype != b.dtype:
        raise NkiValidationError(f"ncc.{op}: {a_name} is {a.dtype} but {b_name} is {b.dtype}; collectives move data "
                                 f"without conversion, dtypes must match")
    if a.dtype in dtypes.PACKED:
        raise NkiValidationError(f"ncc.{op}: packed dtype {a.dtype} is NeuronCore-v4 MX only")


def _reduce_op(op, x):
    o = ops.get(x, f"ncc.{op}", "op")
    if o.name not in _REDUCE_OPS:
        raise NkiValidationError(f"ncc.{op}: op must be nl.add, nl.minimum or nl.maximum (SDK-CC), got {o!r}")
    return o


def _dim(op, kind, collective_dim, allowed_hbm=(0,), allowed_sbuf=(0,)):
    allowed = allowed_hbm if kind == "hbm" else allowed_sbuf
    if not isinstance(collective_dim, (int, np.integer)) or int(collective_dim) not in allowed:
        raise NkiValidationError(f"ncc.{op}: collective_dim={collective_dim!r} is not supported for {kind.upper()} "
                                 f"tensors; expected one of {list(allowed)} (SDK-CC)")
    return int(collective_dim)


def _shape_with(shape, dim, size):
    s = list(shape)
    s[dim] = size
    return s


# ---- rendezvous ------------------------------------------------------------------------------
def _key_name(r, lane):
    return f"rank {r} core {lane}"


def _rendezvous(op, inst, members, spec, payload, compute, reads, writes, info):
    """Issue a collective: trace it, wait for every member (same core index) and run ``compute``
    once with ``{rank: payload}`` when the last member arrives."""
    world = inst.world
    lane = inst.pid
    seq = inst.cc_seq.get(members, 0)
    inst.cc_seq[members] = seq + 1
    key = (lane, members, seq)
    with world.cond:
        e = world.collectives.get(key)
        if e is None:
            world.cc_ids += 1
            e = {"op": op, "spec": spec, "arrived": {}, "done": False, "id": world.cc_ids,
                 "first": inst.rank}
            world.collectives[key] = e
        elif e["op"] != op or e["spec"] != spec:
            raise NkiValidationError(
                f"ncc.{op}: call #{seq + 1} on rank list {list(members)} (core {lane}) does not match what rank "
                f"{e['first']} issued there: {e['op']} {e['spec']} vs {op} {spec}; every member must issue the same "
                f"collectives in the same order")
        cc = {"kind": op, "id": e["id"], "call": seq + 1, "rank_list": list(members),
              "position": members.index(inst.rank), "core": lane,
              "participants": [[r, lane] for r in members]}
        cc.update(info)
        record(op, "CC", reads=reads, writes=writes, collective=cc)
        e["arrived"][inst.rank] = payload
        if len(e["arrived"]) == len(members):
            del world.collectives[key]
            if not inst.shape_only:
                compute({r: e["arrived"][r] for r in members})
            e["done"] = True
            return Instruction(op)

        def describe():
            missing = [r for r in members if r not in e["arrived"]]
            insts = {i.rank: i for i in world.instances if i.pid == lane}
            return (f"ncc.{op} call #{seq + 1} on rank list {list(members)} (core {lane}) waits for "
                    + ", ".join(f"{_key_name(r, lane)} ({world.status_of(insts[r])})" for r in missing))
        world.block(inst, lambda: e["done"], describe)
    return Instruction(op)


# ---- data helpers ----------------------------------------------------------------------------
def _vals(op, name, t):
    """Values of a tensor (row-major, t.shape), checking they were written."""
    return read_raw(f"ncc.{op}", name, t, flat=False)


def _fold(o, arrays, dtype):
    """Reduce arrays (ascending rank order) in fp32, integers exactly; returns values to cast to dtype."""
    if dtypes.is_int(dtype):
        acc = arrays[0].astype(np.int64)
        for a in arrays[1:]:
            acc = o.fn(acc, a.astype(np.int64))
        return acc
    acc = arrays[0].astype(F32)
    with QUIET:
        for a in arrays[1:]:
            acc = np.asarray(o.fn(acc, a.astype(F32)), dtype=F32)
    return acc


def _write_flat(t, start, values):
    """Write ``values`` into row-major elements [start, start + len) of view ``t`` (same dtype)."""
    n = len(values)
    if n == 0:
        return
    idx = np.unravel_index(np.arange(start, start + n), t.shape)
    raw(t)[idx] = values
    mask(t)[idx] = True
    t.storage.dirty = True


def _bytes(ts):
    return int(sum(t.size * t.itemsize for t in ts))


def _info(kind, groups, srcs, dsts, **kw):
    d = {"mem": kind, "replica_group": [list(g) for g in groups], "bytes_in": _bytes(srcs), "bytes_out": _bytes(dsts)}
    d.update(kw)
    return d


def _rw(srcs, dsts, prefix=("srcs", "dsts")):
    return ([(f"{prefix[0]}[{i}]", t) for i, t in enumerate(srcs)],
            [(f"{prefix[1]}[{i}]", t) for i, t in enumerate(dsts)])


def _check_srcs_written(op, srcs, inst, name="srcs"):
    if inst.shape_only:
        return
    for i, t in enumerate(srcs):
        check_written(t, f"ncc.{op}", f"{name}[{i}]")


def _paired(op, srcs, dsts, replica_group, priority):
    """The common checks of the one-dst-per-src collectives: (instance, groups, members, srcs, dsts)."""
    inst = _ctx(op)
    _priority(op, priority)
    groups, members = _rank_list(op, replica_group, inst)
    srcs, dsts = _tlist(op, "srcs", srcs), _tlist(op, "dsts", dsts)
    if len(srcs) != len(dsts):
        raise NkiValidationError(f"ncc.{op}: {len(srcs)} srcs but {len(dsts)} dsts; one dst per src")
    return inst, groups, members, srcs, dsts


# ---- the collectives -------------------------------------------------------------------------
def all_reduce(srcs, dsts, replica_group, op, priority=None, name=None):
    """Element-wise ``op`` (nl.add / nl.minimum / nl.maximum) of ``srcs`` across the rank list into every
    member's ``dsts`` (SDK-CC all_reduce)."""
    w = "all_reduce"
    inst, groups, members, srcs, dsts = _paired(w, srcs, dsts, replica_group, priority)
    kind = _memory(w, srcs, dsts)
    o = _reduce_op(w, op)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        _same_dtype(w, f"srcs[{i}]", s, f"dsts[{i}]", d)
        if s.shape != d.shape:
            raise NkiValidationError(f"ncc.{w}: srcs[{i}] is {list(s.shape)} but dsts[{i}] is {list(d.shape)}; "
                                     f"all_reduce keeps the shape")
    _check_srcs_written(w, srcs, inst)
    spec = (o.name, tuple((s.dtype, s.shape) for s in srcs))

    def compute(by_rank):
        order = sorted(by_rank)                        # fixed order: ascending rank id
        for k in range(len(srcs)):
            vals = [_vals(w, f"rank {r} srcs[{k}]", by_rank[r][0][k]) for r in order]
            res = dtypes.cast(_fold(o, vals, srcs[k].dtype), srcs[k].dtype)
            for r in order:
                write(by_rank[r][1][k], res, exact=True)

    reads, writes = _rw(srcs, dsts)
    return _rendezvous(w, inst, members, spec, (srcs, dsts), compute, reads, writes,
                       _info(kind, groups, srcs, dsts, reduce=o.name))


def all_gather(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """Every member's ``dsts[k]`` = concatenation of the members' ``srcs[k]`` along ``collective_dim`` in
    rank-list order (SDK-CC all_gather: HBM dim 0; SBUF 2-D, dim 0 or 1)."""
    w = "all_gather"
    inst, groups, members, srcs, dsts = _paired(w, srcs, dsts, replica_group, priority)
    kind = _memory(w, srcs, dsts)
    dim = _dim(w, kind, collective_dim, (0,), (0, 1))
    n = len(members)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        _same_dtype(w, f"srcs[{i}]", s, f"dsts[{i}]", d)
        want = _shape_with(s.shape, dim, s.shape[dim] * n)
        if list(d.shape) != want:
            raise NkiValidationError(f"ncc.{w}: dsts[{i}] is {list(d.shape)}, expected {want} (srcs[{i}] "
                                     f"{list(s.shape)} gathered from {n} ranks along dim {dim})")
    _check_srcs_written(w, srcs, inst)
    spec = (dim, tuple((s.dtype, s.shape) for s in srcs))

    def compute(by_rank):
        for k in range(len(srcs)):
            res = np.concatenate([_vals(w, f"rank {r} srcs[{k}]", by_rank[r][0][k]) for r in members], axis=dim)
            for r in members:
                write(by_rank[r][1][k], res, exact=True)

    reads, writes = _rw(srcs, dsts)
    return _rendezvous(w, inst, members, spec, (srcs, dsts), compute, reads, writes,
                       _info(kind, groups, srcs, dsts, dim=dim))


def reduce_scatter(srcs, dsts, replica_group, collective_dim, op, priority=None, name=None):
    """Reduce ``srcs`` across the rank list, then the member at position i receives chunk i along
    ``collective_dim`` (only 0 is supported, SDK-CC)."""
    w = "reduce_scatter"
    inst, groups, members, srcs, dsts = _paired(w, srcs, dsts, replica_group, priority)
    kind = _memory(w, srcs, dsts)
    dim = _dim(w, kind, collective_dim, (0,), (0,))
    o = _reduce_op(w, op)
    n = len(members)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        _same_dtype(w, f"srcs[{i}]", s, f"dsts[{i}]", d)
        if s.shape[0] % n:
            raise NkiValidationError(f"ncc.{w}: srcs[{i}] dim 0 is {s.shape[0]}, not divisible by the {n} ranks")
        want = _shape_with(s.shape, 0, s.shape[0] // n)
        if list(d.shape) != want:
            raise NkiValidationError(f"ncc.{w}: dsts[{i}] is {list(d.shape)}, expected {want} (srcs[{i}] "
                                     f"{list(s.shape)} split over {n} ranks along dim 0)")
    _check_srcs_written(w, srcs, inst)
    spec = (o.name, tuple((s.dtype, s.shape) for s in srcs))

    def compute(by_rank):
        order = sorted(by_rank)
        for k in range(len(srcs)):
            vals = [_vals(w, f"rank {r} srcs[{k}]", by_rank[r][0][k]) for r in order]
            res = dtypes.cast(_fold(o, vals, srcs[k].dtype), srcs[k].dtype)
            c = res.shape[0] // n
            for pos, r in enumerate(members):
                write(by_rank[r][1][k], res[pos * c:(pos + 1) * c], exact=True)

    reads, writes = _rw(srcs, dsts)
    return _rendezvous(w, inst, members, spec, (srcs, dsts), compute, reads, writes,
                       _info(kind, groups, srcs, dsts, dim=0, reduce=o.name))


def all_to_all(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """HBM only, dim 0: chunk j of my src goes to the member at position j; my dst holds the received
    chunks in source position order (SDK-CC; NKL test_collectives: "Each rank sends input[i,:] to rank[i]")."""
    w = "all_to_all"
    inst, groups, members, srcs, dsts = _paired(w, srcs, dsts, replica_group, priority)
    kind = _memory(w, srcs, dsts, hbm_only=True)
    _dim(w, kind, collective_dim, (0,), ())
    n = len(members)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        _same_dtype(w, f"srcs[{i}]", s, f"dsts[{i}]", d)
        if s.shape[0] % n:
            raise NkiValidationError(f"ncc.{w}: srcs[{i}] dim 0 is {s.shape[0]}, not divisible by the {n} ranks")
        if s.shape != d.shape:
            raise NkiValidationError(f"ncc.{w}: dsts[{i}] is {list(d.shape)}, expected the src shape {list(s.shape)}")
    _check_srcs_written(w, srcs, inst)
    spec = (tuple((s.dtype, s.shape) for s in srcs),)

    def compute(by_rank):
        for k in range(len(srcs)):
            vals = {r: _vals(w, f"rank {r} srcs[{k}]", by_rank[r][0][k]) for r in members}
            c = srcs[k].shape[0] // n
            for i, r in enumerate(members):
                res = np.concatenate([vals[s][i * c:(i + 1) * c] for s in members], axis=0)
                write(by_rank[r][1][k], res, exact=True)

    reads, writes = _rw(srcs, dsts)
    return _rendezvous(w, inst, members, spec, (srcs, dsts), compute, reads, writes,
                       _info(kind, groups, srcs, dsts, dim=0))


def _metadata(op, t, rows, n):
    if not isinstance(t, NkiTensor):
        raise TypeError(f"ncc.{op}: metadata_tensor must be a tensor, got {type(t).__name__}")
    if t.dtype != "uint32":
        raise NkiValidationError(f"ncc.{op}: metadata_tensor must be uint32, got {t.dtype}")
    want = (rows, n) if t.buffer in HBM else (1, rows, n)
    if t.buffer == PSUM or tuple(t.shape) != want:
        raise NkiValidationError(f"ncc.{op}: metadata_tensor {t.describe()} must be {list(want)} "
                                 f"({'HBM' if t.buffer in HBM else 'SBUF, one partition'}; {rows} rows x "
                                 f"{n} ranks) (SDK-CC)")
    if not t.is_contiguous():
        raise NkiValidationError(f"ncc.{op}: metadata_tensor must be laid out contiguously (SDK-CC)")
    return t


def all_gather_v(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                 priority=None, name=None):
    """Variable-length all-gather over flat element buffers (SDK-CC all_gather_v, docs "latest"): each
    rank sends ``src[send_displ : send_displ + send_count]`` (column 0 of metadata rows 0/1) to every
    member; sender at position s lands in the receiver's ``dst`` at ``s * dst.size / n`` (or at
    ``recv_displs[s]``, row 3, with ``has_rdispls``). Unless ``recv_counts_known``, row 2 of each
    receiver's metadata gets the received counts. Rank lists must have exactly 4 ranks (ref §5.10)."""
    w = "all_gather_v"
    inst = _ctx(w)
    _priority(w, priority)
    groups, members = _rank_list(w, replica_group, inst)
    srcs, dsts = _tlist(w, "srcs", srcs, 1), _tlist(w, "dsts", dsts, 1)
    kind = _memory(w, srcs, dsts, hbm_only=True)
    n = len(members)
    if n != 4:
        raise NkiValidationError(f"ncc.{w}: rank list {list(members)} has {n} ranks; all_gather_v currently needs "
                                 f"exactly 4 ranks (TP4 intra-chip, SDK-CC)")
    s, d = srcs[0], dsts[0]
    _same_dtype(w, "srcs[0]", s, "dsts[0]", d)
    if d.size % n:
        raise NkiValidationError(f"ncc.{w}: dsts[0] has {d.size} elements, not divisible into {n} equal slots")
    rows = 4 if has_rdispls else 3
    meta = _metadata(w, metadata_tensor, rows, n)
    meta.storage.cc = True
    if not inst.shape_only:
        need = [0, 1] + ([3] if has_rdispls else [])       # inputs: send counts/displs (+ recv displs)
        if not mask(meta).reshape(rows, n, -1)[need].all():
            raise UninitializedReadError(f"ncc.{w}: metadata_tensor {meta.describe()} rows {need} (send counts, send "
                                         f"displacements{', recv displacements' if has_rdispls else ''}) were never "
                                         f"fully written")
    spec = (s.dtype, d.shape, bool(recv_counts_known), bool(has_rdispls))

    def compute(by_rank):
        slot = d.size // n
        chunks = {}
        for r in members:
            src, _, md = by_rank[r]
            m = raw(md).reshape(rows, n)
            cnt, disp = int(m[0, 0]), int(m[1, 0])
            if disp + cnt > src.size:
                raise OutOfBoundsError(f"ncc.{w}: rank {r} sends elements [{disp}, {disp + cnt}) of a src with "
                                       f"{src.size} elements")
            if not has_rdispls and cnt > slot:
                raise OutOfBoundsError(f"ncc.{w}: rank {r} sends {cnt} elements into slots of {slot} "
                                       f"(dst.size / {n})")
            flat = np.asarray(_vals(w, f"rank {r} srcs[0]", src)).reshape(-1)
            chunks[r] = flat[disp:disp + cnt]
        for r in members:
            _, dst, md = by_rank[r]
            m = raw(md).reshape(rows, n)
            for pos, sndr in enumerate(members):
                start = int(m[3, pos]) if has_rdispls else pos * slot
                if start + len(chunks[sndr]) > dst.size:
                    raise OutOfBoundsError(f"ncc.{w}: rank {r} receives rank {sndr}'s {len(chunks[sndr])} elements at "
                                           f"{start}, past its dst of {dst.size}")
                _write_flat(dst, start, chunks[sndr])
            if not recv_counts_known:
                counts = np.array([len(chunks[x]) for x in members], dtype=np.uint32)
                _write_flat(md, 2 * n, counts)

    reads = [("srcs[0]", s), ("metadata_tensor", meta)]
    writes = [("dsts[0]", d)] + ([] if recv_counts_known else [("metadata_tensor", meta)])
    return _rendezvous(w, inst, members, spec, (s, d, meta), compute, reads, writes,
                       _info(kind, groups, srcs, dsts, recv_counts_known=bool(recv_counts_known),
                             has_rdispls=bool(has_rdispls)))


def all_to_all_v(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                 priority=None, name=None):
    w = "all_to_all_v"
    _ctx(w)
    raise NkiValidationError(
        f"ncc.{w}: on trn2 (no NeuronSwitch fabric) all_to_all_v supports only inter-node replica groups "
        f"(same-indexed ranks of different Trn instances, SDK-CC); every rank of an nkisim launch is on one "
        f"chip. Use all_to_all with fixed-size chunks")


def collective_permute(srcs, dsts, source_target_pairs, priority=None, name=None):
    """HBM, exactly one tensor: for each ``(source, target)`` pair the target's dst receives the source's
    src (SDK-CC). A rank that is no pair's target keeps its dst unchanged (inference)."""
    w = "collective_permute"
    inst = _ctx(w)
    _priority(w, priority)
    srcs, dsts = _tlist(w, "srcs", srcs, 1), _tlist(w, "dsts", dsts, 1)
    kind = _memory(w, srcs, dsts, hbm_only=True)
    s, d = srcs[0], dsts[0]
    _same_dtype(w, "srcs[0]", s, "dsts[0]", d)
    if s.shape != d.shape:
        raise NkiValidationError(f"ncc.{w}: dsts[0] is {list(d.shape)}, expected the src shape {list(s.shape)}")
    tp = inst.world.tp
    try:
        pairs = tuple((int(a), int(b)) for a, b in source_target_pairs)
    except (TypeError, ValueError):
        raise TypeError(f"ncc.{w}: source_target_pairs must be a list of (source, target) rank pairs, got "
                        f"{source_target_pairs!r}") from None
    for a, b in pairs:
        if not (0 <= a < tp and 0 <= b < tp):
            raise NkiValidationError(f"ncc.{w}: pair ({a}, {b}) names a rank outside 0..{tp - 1}")
    for nm, col in (("source", [a for a, _ in pairs]), ("target", [b for _, b in pairs])):
        dup = sorted({x for x in col if col.count(x) > 1})
        if dup:
            raise NkiValidationError(f"ncc.{w}: rank(s) {dup} appear more than once as a {nm} in {list(pairs)}")
    members = tuple(sorted({r for p in pairs for r in p}))
    reads, writes = _rw(srcs, dsts)
    if inst.rank not in members:            # not part of the permutation: nothing to send or receive
        record(w, "CC", collective={"kind": w, "id": None, "rank_list": [], "participants": [], "core": inst.pid,
                                    "pairs": [list(p) for p in pairs], "mem": kind, "bytes_in": 0, "bytes_out": 0})
        return Instruction(w)
    _check_srcs_written(w, srcs, inst)
    spec = (pairs, s.dtype, s.shape)

    def compute(by_rank):
        vals = {a: np.array(_vals(w, f"rank {a} srcs[0]", by_rank[a][0])) for a, _ in pairs}
        for a, b in pairs:
            write(by_rank[b][1], vals[a], exact=True)

    sends = [b for a, b in pairs if a == inst.rank]
    recvs = [a for a, b in pairs if b == inst.rank]
    return _rendezvous(w, inst, members, spec, (s, d), compute, reads if sends else [], writes if recvs else [],
                       {"mem": kind, "pairs": [list(p) for p in pairs], "send_to": sends, "recv_from": recvs,
                        "bytes_in": _bytes([s]) if sends else 0, "bytes_out": _bytes([d]) if recvs else 0})


def _channels(op, inst, members, by_channel, names, channel_ids):
    if not isinstance(channel_ids, (list, tuple)) or list(channel_ids) != list(range(len(channel_ids))) or not channel_ids:
        raise NkiValidationError(f"ncc.{op}: channel_ids must be consecutive integers starting from 0, got "
                                 f"{channel_ids!r} (SDK-CC)")
    k = len(channel_ids)
    # SDK-CC: at most 4 channels for replica groups containing all devices of a node, 2 otherwise
    limit = 4 if len(members) == inst.world.tp else 2
    if k > limit:
        raise NkiValidationError(f"ncc.{op}: {k} channels; at most {limit} for rank list {list(members)} "
                                 f"({'all ranks of the node' if limit == 4 else 'a subset of the node'}, SDK-CC)")
    out = []
    for nm, lst in zip(names, by_channel):
        if not isinstance(lst, (list, tuple)) or len(lst) != k:
            raise NkiValidationError(f"ncc.{op}: {nm} must be a list with one tensor list per channel ({k} channels), "
                                     f"got {lst!r}")
        out.append([_tlist(op, f"{nm}[{c}]", inner, 1)[0] for c, inner in enumerate(lst)])
    return out


def collective_permute_implicit(srcs_by_channel, dsts_by_channel, replica_group, channel_ids=[0], priority=None,
                                name=None):
    """Ring step: each member sends its per-channel src to its successor in the rank list and receives its
    predecessor's into dst (SDK-CC)."""
    w = "collective_permute_implicit"
    inst = _ctx(w)
    _priority(w, priority)
    groups, members = _rank_list(w, replica_group, inst)
    srcs, dsts = _channels(w, inst, members, (srcs_by_channel, dsts_by_channel),
                           ("srcs_by_channel", "dsts_by_channel"), channel_ids)
    kind = _memory(w, srcs, dsts, per_channel=True)
    for c, (s, d) in enumerate(zip(srcs, dsts)):
        _same_dtype(w, f"srcs_by_channel[{c}]", s, f"dsts_by_channel[{c}]", d)
        if s.shape != d.shape:
            raise NkiValidationError(f"ncc.{w}: channel {c}: dst {list(d.shape)} must have the src shape {list(s.shape)}")
    _check_srcs_written(w, srcs, inst, "srcs_by_channel")
    spec = (tuple((s.dtype, s.shape) for s in srcs),)
    n = len(members)

    def compute(by_rank):
        for c in range(len(srcs)):
            vals = {r: np.array(_vals(w, f"rank {r} srcs_by_channel[{c}]", by_rank[r][0][c])) for r in members}
            for i, r in enumerate(members):
                write(by_rank[r][1][c], vals[members[(i - 1) % n]], exact=True)

    reads, writes = _rw(srcs, dsts, ("srcs_by_channel", "dsts_by_channel"))
    i = members.index(inst.rank)
    return _rendezvous(w, inst, members, spec, (srcs, dsts), compute, reads, writes,
                       _info(kind, groups, srcs, dsts, channels=len(srcs), send_to=[members[(i + 1) % n]],
                             recv_from=[members[(i - 1) % n]]))


def collective_permute_implicit_reduce(srcs0_by_channel, srcs1_by_channel, dsts_by_channel, replica_group, op,
                                       channel_ids=[0], priority=None, name=None):
    """Ring step with reduction: each member computes ``op(srcs0[c], srcs1[c])`` (fp32, rounded to the
    dst dtype), sends it to its successor and receives its predecessor's into ``dsts[c]`` (SDK-CC)."""
    w = "collective_permute_implicit_reduce"
    inst = _ctx(w)
    _priority(w, priority)
    groups, members = _rank_list(w, replica_group, inst)
    s0, s1, dsts = _channels(w, inst, members, (srcs0_by_channel, srcs1_by_channel, dsts_by_channel),
                             ("srcs0_by_channel", "srcs1_by_channel", "dsts_by_channel"), channel_ids)
    kind = _memory(w, s0 + s1, dsts, per_channel=True)
    o = _reduce_op(w, op)
    for c, (a, b, d) in enumerate(zip(s0, s1, dsts)):
        _same_dtype(w, f"srcs0_by_channel[{c}]", a, f"dsts_by_channel[{c}]", d)
        _same_dtype(w, f"srcs1_by_channel[{c}]", b, f"dsts_by_channel[{c}]", d)
        if not a.shape == b.shape == d.shape:
            raise NkiValidationError(f"ncc.{w}: channel {c}: srcs0 {list(a.shape)}, srcs1 {list(b.shape)} and dst "
                                     f"{list(d.shape)} must have the same shape")
    _check_srcs_written(w, s0, inst, "srcs0_by_channel")
    _check_srcs_written(w, s1, inst, "srcs1_by_channel")
    spec = (o.name, tuple((s.dtype, s.shape) for s in s0))
    n = len(members)

    def compute(by_rank):
        for c in range(len(dsts)):
            red = {}
            for r in members:
                a = _vals(w, f"rank {r} srcs0_by_channel[{c}]", by_rank[r][0][c])
                b = _vals(w, f"rank {r} srcs1_by_channel[{c}]", by_rank[r][1][c])
                red[r] = dtypes.cast(_fold(o, [a, b], dsts[c].dtype), dsts[c].dtype)
            for i, r in enumerate(members):
                write(by_rank[r][2][c], red[members[(i - 1) % n]], exact=True)

    reads = [(f"srcs0_by_channel[{c}]", t) for c, t in enumerate(s0)] + \
            [(f"srcs1_by_channel[{c}]", t) for c, t in enumerate(s1)]
    writes = [(f"dsts_by_channel[{c}]", t) for c, t in enumerate(dsts)]
    i = members.index(inst.rank)
    return _rendezvous(w, inst, members, spec, (s0, s1, dsts), compute, reads, writes,
                       _info(kind, groups, s0 + s1, dsts, channels=len(dsts), reduce=o.name,
                             send_to=[members[(i + 1) % n]], recv_from=[members[(i - 1) % n]]))


def collective_permute_implicit_current_processing_rank_id(iteration_id, replica_group, channel_id=0, name=None):
    """Register holding the rank whose data a ring step processes: the caller's own rank at iteration 0,
    then its predecessors around the ring (SDK-CC)."""
    w = "collective_permute_implicit_current_processing_rank_id"
    inst = _ctx(w)
    _, members = _rank_list(w, replica_group, inst)
    if not isinstance(channel_id, (int, np.integer)) or not 0 <= int(channel_id) < 4:
        raise NkiValidationError(f"ncc.{w}: channel_id must be an int in 0..3, got {channel_id!r}")
    it = iteration_id.value if isinstance(iteration_id, VirtualRegister) else iteration_id
    if not isinstance(it, (int, np.integer)):
        raise TypeError(f"ncc.{w}: iteration_id must be an int or a VirtualRegister, got {type(iteration_id).__name__}")
    record(w, "SP")
    n = len(members)
    return VirtualRegister(members[(members.index(inst.rank) - int(it)) % n])


def rank_id(name=None):
    """A register holding this rank's id (SDK-CC rank_id)."""
    inst = current("ncc.rank_id")
    record("rank_id", "SP")
    return VirtualRegister(inst.rank)


frontend.register_api_module(sys.modules[__name__], "nki.collectives")
frontend.register_api_class(ReplicaGroup, "nki.collectives.ReplicaGroup")
