"""Event-driven timeline of a trace on trn2 physical cores.

Streams (each executes its instructions in program order, one at a time):

* per core: PE, ACT, DVE, POOL, SP (compute; duration from ``costs.compute_ns``, ACT table loads added
  when the activation group changes), CC (nki.collectives, in order);
* per core: 16 DMA queues. DMA instructions are assigned round-robin in program order (a static queue
  assignment, as a compiler would make). A DMA occupies its queue from issue to completion:
  issue on one of the core's 2 DGEs (``DMA_ISSUE_NS``), data phase on the rank's HBM pipe, completion
  latency (``DMA_COMPLETION_NS``).
* the rank's HBM pipe is processor-shared: every DMA in its data phase gets an equal share of
  ``HBM_BW_PER_RANK`` (both cores of the rank compete).

An instruction starts when its stream is free and all its dependencies (RAW/WAR/WAW from ``deps``)
have finished. ``core_barrier`` (both cores of a rank), ``sendrecv`` (the pair with the same pipe id)
and collectives (every traced core; ranks not in the trace are assumed to arrive with the traced ones)
are rendezvous: each participant blocks its stream from its arrival until max(arrivals) + cost.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from . import constants as C
from . import costs
from .deps import DependencyBuilder

K_COMPUTE, K_DMA, K_SYNC = 0, 1, 2
REGISTER_WRITERS = frozenset({"register_load", "register_move", "rank_id"})
EV_FINISH, EV_ISSUED, EV_PIPE = 0, 1, 2


@dataclass
class Program:
    """A trace turned into arrays the simulator walks."""
    recs: list
    cores: list                      # core key (rank, inst) per core index
    core: list = field(default_factory=list)       # core index per instruction
    rank: list = field(default_factory=list)       # rank index per instruction
    stream: list = field(default_factory=list)     # stream index per instruction
    kind: list = field(default_factory=list)
    dur: list = field(default_factory=list)        # compute duration (incl. table load) / sync cost
    tload: list = field(default_factory=list)      # ACT table-load ns included in dur
    issue: list = field(default_factory=list)      # DMA issue ns
    nbytes: list = field(default_factory=list)     # DMA pipe bytes
    preds: list = field(default_factory=list)
    streams: list = field(default_factory=list)    # stream index -> (core index, name)
    stream_insts: list = field(default_factory=list)
    groups: dict = field(default_factory=dict)     # instruction -> rendezvous group id
    group_members: list = field(default_factory=list)


def _core_key(rec):
    return (rec.get("rank", 0) or 0, rec.get("inst", 0) or 0)


def build(recs, pe_throttle=False, physical_deps=False) -> Program:
    cores = sorted({_core_key(r) for r in recs})
    core_idx = {k: i for i, k in enumerate(cores)}
    ranks = sorted({k[0] for k in cores})
    rank_idx = {r: i for i, r in enumerate(ranks)}
    lnc_of_rank = {r: sum(1 for k in cores if k[0] == r) for r in ranks}
    P = Program(recs=recs, cores=cores)
    sid = {}

    def stream_of(ci, name):
        k = (ci, name)
        s = sid.get(k)
        if s is None:
            s = sid[k] = len(P.streams)
            P.streams.append(k)
            P.stream_insts.append([])
        return s

    dma_rr = [0] * len(cores)
    last_reg = [None] * len(cores)     # latest register-writing instruction per core
    last_int = [None] * len(cores)     # latest instruction writing an integer on-chip tile per core
    act_group = [None] * len(cores)
    counters = {}                    # rendezvous occurrence counters
    group_id = {}
    builder = DependencyBuilder(physical=physical_deps)
    n_ranks_total = max(C.TP_RANKS, len(ranks))
    for i, rec in enumerate(recs):
        ck = _core_key(rec)
        ci = core_idx[ck]
        eng, op = rec["engine"], rec["op"]
        tl = 0.0
        issue = 0.0
        nb = 0
        cc = rec.get("collective")
        if op in costs.COLLECTIVE_OPS or eng == "CC":
            s = stream_of(ci, "CC")
            if cc is not None and cc.get("id") is None:
                kind, d, gkey = K_COMPUTE, 0.0, None        # a rank outside the permutation: no-op
            else:
                kind = K_SYNC
                d = costs.sync_ns(rec, n_ranks_total)
                if cc is not None:                           # nkisim.launch record: the id names the group
                    gkey, gsize = ("cc", cc["id"]), len(cc.get("participants") or cores)
                else:                                        # synthetic: k-th collective of every core
                    n = counters[("cc", ci)] = counters.get(("cc", ci), -1) + 1
                    gkey, gsize = ("cc", n), len(cores)
        elif op in costs.BARRIER_OPS:
            kind, s = K_SYNC, stream_of(ci, eng)
            d = costs.sync_ns(rec, n_ranks_total)
            n = counters[("bar", ci)] = counters.get(("bar", ci), -1) + 1
            gkey, gsize = ("bar", ck[0], n), lnc_of_rank[ck[0]]
        elif op in costs.SENDRECV_OPS:
            kind = K_SYNC
            q = dma_rr[ci] % C.DMA_QUEUES_PER_CORE
            dma_rr[ci] += 1
            s = stream_of(ci, f"DMA{q}")
            d = costs.sync_ns(rec, n_ranks_total)
            pk = ("sr", ci, rec.get("pipe"))
            n = counters[pk] = counters.get(pk, -1) + 1
            gkey, gsize = ("sr", ck[0], rec.get("pipe"), n), 2
        elif eng == "DMA":
            kind = K_DMA
            q = dma_rr[ci] % C.DMA_QUEUES_PER_CORE
            dma_rr[ci] += 1
            s = stream_of(ci, f"DMA{q}")
            d = 0.0
            issue = costs.dma_issue_ns(rec)
            nb = costs.transfer_bytes(rec)
            gkey = None
        else:
            kind, s = K_COMPUTE, stream_of(ci, eng)
            d = costs.compute_ns(rec, pe_throttle=pe_throttle)
            if eng == "ACT":
                g = costs.act_group(rec.get("func"))
                if g is not None and g != act_group[ci]:
                    tl = C.ACT_TABLE_LOAD_NS
                    act_group[ci] = g
            d += tl
            gkey = None
        if gkey is not None:
            g = group_id.get(gkey)
            if g is None:
                g = group_id[gkey] = len(P.group_members)
                P.group_members.append([])
            P.groups[i] = g
            P.group_members[g].append(i)
            if len(P.group_members[g]) > gsize:
                raise ValueError(f"costmodel: rendezvous {gkey} has more than {gsize} participants "
                                 f"(instruction {i} {op} at {rec.get('loc')})")
        P.core.append(ci)
        P.rank.append(rank_idx[ck[0]])
        P.stream.append(s)
        P.kind.append(kind)
        P.dur.append(d)
        P.tload.append(tl)
        P.issue.append(issue)
        P.nbytes.append(nb)
        P.stream_insts[s].append(i)
        reads, writes = rec.get("reads", ()), rec.get("writes", ())
        if op in costs.BARRIER_OPS:
            writes = reads          # a barrier fences its `data` tensor: later accesses wait for it
        deps = builder.access(i, s, ci, reads, writes)
        # Dynamic addressing (workaround: the trace names neither registers nor vector_offset index tiles).
        # A scalar-offset access waits for the core's latest register write (SP register ops run in order);
        # a vector-offset gather/scatter waits for the core's latest write of an integer on-chip tile.
        if kind == K_DMA:
            for reg in (*reads, *writes):
                ind = reg.get("indirect")
                if ind == "scalar" and last_reg[ci] is not None:
                    deps.add(last_reg[ci])
                elif ind == "vector" and last_int[ci] is not None:
                    deps.add(last_int[ci])
        if op in REGISTER_WRITERS:
            last_reg[ci] = i
        if writes:
            dts = rec.get("dtypes")
            if dts:
                for w in writes:
                    dt = dts.get(w.get("arg"))
                    if dt and dt[0] in "iu" and "part" in w:      # int*/uint* on-chip tile
                        last_int[ci] = i
                        break
        st = P.stream
        if gkey is not None:        # members of one rendezvous never wait for each other
            g = P.groups[i]
            deps = [p for p in deps if P.groups.get(p) != g]
        P.preds.append([p for p in deps if st[p] != s])
    return P


@dataclass
class Timeline:
    program: Program
    start: list          # when the instruction began occupying its stream (DMA: issue start; sync: arrival)
    finish: list
    work_start: list     # start of its own work (sync: max arrival; compute: start; DMA: issue start)
    binder: list         # (instruction, release time) that determined the start, or None (time 0)
    end: float
    pipe_busy: list      # per rank: ns with at least one DMA in its data phase


class _Pipe:
    """Processor-shared bandwidth: virtual time V advances at bw / n per active transfer."""
    __slots__ = ("bw", "V", "t", "active", "version", "busy", "busy_since")

    def __init__(self, bw):
        self.bw = bw            # bytes per ns
        self.V = 0.0
        self.t = 0.0
        self.active = []        # heap of (finish V, idx)
        self.version = 0
        self.busy = 0.0
        self.busy_since = None

    def advance(self, now):
        n = len(self.active)
        if n:
            self.V += (now - self.t) * self.bw / n
        self.t = now

    def next_time(self):
        if not self.active:
            return None
        return self.t + max(self.active[0][0] - self.V, 0.0) * len(self.active) / self.bw


def simulate(P: Program) -> Timeline:
    n = len(P.recs)
    start = [0.0] * n
    finish = [0.0] * n
    work_start = [0.0] * n
    binder = [None] * n
    npred = [len(p) for p in P.preds]
    succ = [[] for _ in range(n)]
    for i, ps in enumerate(P.preds):
        for p in ps:
            succ[p].append(i)
    ready_t = [0.0] * n
    ready_by = [None] * n
    ns = len(P.streams)
    ptr = [0] * ns
    busy = [False] * ns
    prev_fin = [(None, 0.0)] * ns          # (last instruction, its finish) per stream
    ncores = len(P.cores)
    dge = [[(0.0, None)] * C.DMA_DGE_PER_CORE for _ in range(ncores)]   # (free time, holder)
    nranks = max(P.rank) + 1 if n else 1
    pipes = [_Pipe(C.HBM_BW_PER_RANK / 1e9) for _ in range(nranks)]
    arrived = {}                            # group -> list of (arrival, idx)
    heap = []
    ctr = 0
    kind, dur, stream, core = P.kind, P.dur, P.stream, P.core
    insts = P.stream_insts

    def push(t, ev, x):
        nonlocal ctr
        ctr += 1
        heapq.heappush(heap, (t, ctr, ev, x))

    def pipe_schedule(pp, r):
        t = pp.next_time()
        pp.version += 1
        if t is not None:
            push(t, EV_PIPE, (r, pp.version))

    def dispatch(i, now):
        s = stream[i]
        busy[s] = True
        start[i] = now
        pi, pf = prev_fin[s]
        # what released this instruction: the later of its last dependency and its stream predecessor
        if ready_by[i] is not None and ready_t[i] >= pf:
            binder[i] = (ready_by[i], ready_t[i])
        elif pi is not None:
            binder[i] = (pi, pf)
        k = kind[i]
        if k == K_COMPUTE:
            work_start[i] = now
            push(now + dur[i], EV_FINISH, i)
        elif k == K_DMA:
            slots = dge[core[i]]
            j = min(range(len(slots)), key=lambda x: slots[x][0])
            free, holder = slots[j]
            t0 = max(now, free)
            if t0 > now and holder is not None:
                binder[i] = (holder, free)
            work_start[i] = t0
            t1 = t0 + P.issue[i]
            slots[j] = (t1, i)
            push(t1, EV_ISSUED, i)
        else:
            g = P.groups[i]
            lst = arrived.setdefault(g, [])
            lst.append((now, i))
            members = P.group_members[g]
            if len(lst) == len(members):
                t_last, last = max(lst)
                endt = t_last + dur[i]
                for (ta, m) in lst:
                    work_start[m] = t_last
                    if m != last:
                        binder[m] = (last, t_last)
                    push(endt, EV_FINISH, m)
                del arrived[g]

    def try_start(i, now):
        s = stream[i]
        if npred[i] == 0 and not busy[s] and insts[s][ptr[s]] == i:
            dispatch(i, now)

    for s in range(ns):
        if insts[s]:
            try_start(insts[s][0], 0.0)

    end = 0.0
    while heap:
        now, _, ev, x = heapq.heappop(heap)
        if ev == EV_PIPE:
            r, ver = x
            pp = pipes[r]
            if ver != pp.version:
                continue
            pp.advance(now)
            eps = 1e-6
            while pp.active and pp.active[0][0] <= pp.V + eps:
                _, i = heapq.heappop(pp.active)
                push(now + C.DMA_COMPLETION_NS, EV_FINISH, i)
            if not pp.active and pp.busy_since is not None:
                pp.busy += now - pp.busy_since
                pp.busy_since = None
            pipe_schedule(pp, r)
            continue
        if ev == EV_ISSUED:
            i = x
            nb = P.nbytes[i]
            if nb <= 0:
                push(now + C.DMA_COMPLETION_NS, EV_FINISH, i)
                continue
            r = P.rank[i]
            pp = pipes[r]
            pp.advance(now)
            if pp.busy_since is None:
                pp.busy_since = now
            heapq.heappush(pp.active, (pp.V + nb, i))
            pipe_schedule(pp, r)
            continue
        # EV_FINISH
        i = x
        finish[i] = now
        if now > end:
            end = now
        s = stream[i]
        busy[s] = False
        prev_fin[s] = (i, now)
        ptr[s] += 1
        for j in succ[i]:
            npred[j] -= 1
            if now >= ready_t[j]:
                ready_t[j] = now
                ready_by[j] = i
            if npred[j] == 0:
                try_start(j, now)
        if ptr[s] < len(insts[s]):
            try_start(insts[s][ptr[s]], now)

    stuck = [s for s in range(ns) if ptr[s] < len(insts[s])]
    if stuck:
        s = stuck[0]
        i = insts[s][ptr[s]]
        rec = P.recs[i]
        raise RuntimeError(f"costmodel: the timeline deadlocked: {len(stuck)} streams never finished; first: "
                           f"core {P.cores[P.streams[s][0]]} {P.streams[s][1]} at instruction {i} {rec['op']} "
                           f"({rec.get('loc')}), {npred[i]} unfinished dependencies"
                           + (f", rendezvous group incomplete" if i in P.groups else ""))
    return Timeline(P, start, finish, work_start, binder, end, [p.busy for p in pipes])
