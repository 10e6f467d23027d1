"""Event-driven timeline of a trace on trn2 physical cores, at one end of the bands (``costs.Params``).

:func:`build` turns the trace into a band-independent :class:`Program` (streams, dependencies, loop
boundaries, per-instruction cost inputs); :func:`simulate` runs it at one ``Params``. Building once and
simulating three times gives the low / central / high band cheaply.

Streams (each executes its instructions in program order, one at a time): per core PE, ACT, DVE, POOL, SP
(compute; ``costs.compute_ns``, plus an ACT table load when the activation group changes), CC (collectives),
SR (sendrecv). A DMA is *triggered* from an instruction queue: software-DGE DMAs (vector-offset gathers and
scatters, ``dge_mode=swdge``) from POOL, which writes their descriptors (``DMA_ISSUE_NS`` /
``DMA_ISSUE_INDIRECT_NS`` of POOL time); hardware-DGE DMAs from the SP or ACT queue (the ``engine=`` given, else
the band's ``dma_trigger_queue``), where the trigger waits in program order and then takes one of the core's 2
DGEs for ``DMA_ISSUE_NS``. Then its data phase: every DMA moving on a rank shares, max-min fair, (a) its own
engines (min(16, partitions) x 23 B/ns, divided by its size inflation 1 + descriptor overhead / run bytes), (b)
the 16 engines of its core (368 B/ns of inflated bytes) and (c) the rank's HBM bandwidth (HBM bytes only; both
cores compete). The DMAs of one trigger queue move in order (SDK nki/get-started/about/nki-dma-overview.rst "DMA
Queues": "DMA transfers within a queue on the same DMA engine are executed in order. DMA transfers from different
DMA queues are scheduled in a round robin fashion"; the queue "is typically tied to the trigger engine and the method
of descriptor generation"): a DMA's data phase starts when the data phase of the queue's previous DMA has ended, so
only the head of each queue (SP, ACT, POOL per core) shares the engines and the HBM. This treats every DMA of a queue
as occupying all the engines it could use (a narrow DMA followed by a wide one on the same queue: the wide one waits
for it entirely, pessimistic). A band end without a default trigger queue (``dma_trigger_queue`` "none") orders
only the DMAs whose queue the kernel names (``engine=``, software DGE); all others share. Then the completion
latency.

An instruction starts when its stream lets it and every instruction it depends on (RAW/WAR/WAW from ``deps``,
RAW on registers) has finished plus the hand-off: a consumer on another engine waits ``handoff_ns`` after its
producer, a DMA ``handoff_dma_ns`` (semaphore-to-start), nothing when the producer is the DMA's own trigger
queue. Loop boundaries (``loop_fences``) are fences: everything the core issued before waits, everything after
starts after it (plus the hand-off). ``core_barrier`` (both cores of a rank), ``sendrecv`` (the pair with the
same pipe id) and collectives (every traced core; ranks not in the trace are assumed to arrive with the traced
ones) are rendezvous: each participant blocks its stream from its arrival until max(arrivals) + cost.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from . import constants as C
from . import costs
from .deps import DependencyBuilder

K_COMPUTE, K_DMA, K_SYNC, K_FENCE = 0, 1, 2, 3
EV_FINISH, EV_READY, EV_TRIG, EV_ISSUED, EV_PIPE, EV_FREE = 0, 1, 2, 3, 4, 5
_INF = float("inf")


@dataclass
class Program:
    """A trace turned into band-independent arrays the simulator walks (index = position in ``recs``)."""
    recs: list
    cores: list                      # core key (rank, inst) per core index
    core: list = field(default_factory=list)       # core index per instruction
    rank: list = field(default_factory=list)       # rank index per instruction
    kind: list = field(default_factory=list)
    stream: list = field(default_factory=list)     # compute / sync stream index (-1 for DMAs)
    streams: list = field(default_factory=list)    # stream index -> (core index, name)
    base: list = field(default_factory=list)       # compute ns without bands (PE: streaming time)
    is_pe: list = field(default_factory=list)
    tload: list = field(default_factory=list)      # ACT table-load ns
    dma: dict = field(default_factory=dict)        # instruction -> (payload B, HBM B, engines, run B, trigger rec)
    sync: dict = field(default_factory=dict)       # instruction -> record (its cost depends on the band)
    preds: list = field(default_factory=list)
    groups: dict = field(default_factory=dict)     # instruction -> rendezvous group id
    group_members: list = field(default_factory=list)
    order: list = field(default_factory=list)      # core index -> its instructions in program order
    boundaries: list = field(default_factory=list)  # (core index, position in order, "entry" | "iteration" | "exit")
    loops: list = field(default_factory=list)       # the trace's runtime-loop records
    n_ranks_total: int = C.TP_RANKS


def _core_key(rec):
    return (rec.get("rank", 0) or 0, rec.get("inst", 0) or 0)


def build(recs, loops=(), physical_deps=True) -> Program:
    """The Program of a trace: ``recs`` its instruction records, ``loops`` its ``Trace.loops`` records.
    physical_deps: key on-chip hazards by physical address (nkisim's first-fit placement, so reuse of a freed
    tile waits for its last reader: on by default) instead of buffer id."""
    cores = sorted({_core_key(r) for r in recs})
    core_idx = {k: i for i, k in enumerate(cores)}
    ranks = sorted({k[0] for k in cores})
    rank_idx = {r: i for i, r in enumerate(ranks)}
    lnc_of_rank = {r: sum(1 for k in cores if k[0] == r) for r in ranks}
    P = Program(recs=recs, cores=cores, order=[[] for _ in cores])
    P.n_ranks_total = max(C.TP_RANKS, len(ranks))
    sid = {}

    def stream_of(ci, name):
        k = (ci, name)
        s = sid.get(k)
        if s is None:
            s = sid[k] = len(P.streams)
            P.streams.append(k)
        return s

    act_group = [None] * len(cores)
    counters = {}
    group_id = {}
    reg_writer = {}                  # (core, register id) -> instruction
    builder = DependencyBuilder(physical=physical_deps)
    for i, rec in enumerate(recs):
        ck = _core_key(rec)
        ci = core_idx[ck]
        eng, op = rec["engine"], rec["op"]
        tl, base, pe, s = 0.0, 0.0, False, -1
        cc = rec.get("collective")
        gkey = None
        if op in costs.COLLECTIVE_OPS or eng == "CC":
            s = stream_of(ci, "CC")
            if cc is not None and cc.get("id") is None:
                kind = K_COMPUTE                             # a rank outside the permutation: no-op
            else:
                kind = K_SYNC
                P.sync[i] = rec
                if cc is not None:                           # nkisim.launch record: the id names the group
                    gkey, gsize = ("cc", rec.get("launch"), cc["id"]), len(cc.get("participants") or cores)
                else:                                        # synthetic: k-th collective of every core
                    n = counters[("cc", ci)] = counters.get(("cc", ci), -1) + 1
                    gkey, gsize = ("cc", n), len(cores)
        elif op in costs.BARRIER_OPS:
            kind, s = K_SYNC, stream_of(ci, eng)
            P.sync[i] = rec
            n = counters[("bar", ci)] = counters.get(("bar", ci), -1) + 1
            gkey, gsize = ("bar", ck[0], n), lnc_of_rank[ck[0]]
        elif op in costs.SENDRECV_OPS:
            kind, s = K_SYNC, stream_of(ci, "SR")
            P.sync[i] = rec
            pk = ("sr", ci, rec.get("pipe"))
            n = counters[pk] = counters.get(pk, -1) + 1
            gkey, gsize = ("sr", ck[0], rec.get("pipe"), n), 2
        elif eng == "DMA":
            kind = K_DMA
            r, w = costs.hbm_bytes(rec)
            P.dma[i] = (costs.payload_bytes(rec), r + w, costs.dma_engines(rec), costs.dma_run_bytes(rec),
                        costs.dma_issue_ns(rec), rec)
        else:
            kind, s = K_COMPUTE, stream_of(ci, eng)
            pe = eng == "PE"
            base = costs.pe_stream_ns(rec, pinned=bool(rec.get("tile_position"))) if pe else costs.fixed_compute_ns(rec)
            if eng == "ACT":
                g = costs.act_group(rec.get("func"))
                if g is not None and g != act_group[ci]:
                    tl = C.ACT_TABLE_LOAD_NS
                    act_group[ci] = g
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
        P.kind.append(kind)
        P.stream.append(s)
        P.base.append(base)
        P.is_pe.append(pe)
        P.tload.append(tl)
        P.order[ci].append(i)
        reads, writes = rec.get("reads", ()), rec.get("writes", ())
        if op in costs.BARRIER_OPS:
            writes = reads          # a barrier fences its `data` tensor: later accesses wait for it
        dkey = s if s >= 0 else -(i + 1)        # a DMA completes out of order: its own dependency stream
        deps = builder.access(i, dkey, ci, reads, writes)
        for r in rec.get("reg_reads", ()):
            w = reg_writer.get((ci, r))
            if w is not None:
                deps.add(w)
        for r in rec.get("reg_writes", ()):
            reg_writer[(ci, r)] = i
        if gkey is not None:        # members of one rendezvous never wait for each other
            g = P.groups[i]
            deps = [p for p in deps if P.groups.get(p) != g]
        st = P.stream
        P.preds.append([p for p in deps if p != i and (s < 0 or st[p] != s)])
    P.loops = list(loops)
    P.boundaries = _boundaries(P, recs, loops, core_idx)
    return P


def _boundaries(P, recs, loops, core_idx):
    """Runtime-loop boundaries per core, as (core, k, kind): a fence between the core's k-th instruction (position
    in ``P.order``; -1 = before the first) and the next. Kinds: "entry", "iteration" (an iteration ended and the
    next began), "exit", and "empty" (a loop that ran 0 times: its exit has no work of its own to wait for)."""
    pos = {}
    for ci, lst in enumerate(P.order):
        for k, i in enumerate(lst):
            pos[recs[i].get("seq", i)] = (ci, k)
    out = set()
    for lp in loops:
        ci = core_idx.get((lp.get("rank", 0) or 0, lp.get("inst", 0) or 0))
        if ci is None:
            continue
        exit_kind = "empty" if lp.get("trips") == 0 else "exit"
        for key, kind in (("before", "entry"), ("last", exit_kind)):
            seq = lp.get(key, -1)
            if seq is not None and seq >= 0 and seq in pos and pos[seq][0] == ci:
                out.add((ci, pos[seq][1], kind))
            elif seq == -1 and kind != "entry":
                out.add((ci, -1, kind))
    for ci, lst in enumerate(P.order):
        prev = None
        for k, i in enumerate(lst):
            lp = recs[i].get("loop")
            cur = {x[0]: x[1] for x in lp} if lp else {}
            if prev:
                for lid, it in cur.items():
                    if lid in prev and prev[lid] != it:
                        out.add((ci, k - 1, "iteration"))
                        break
            prev = cur
    return sorted(out)


@dataclass
class Timeline:
    program: Program
    params: costs.Params
    start: list          # when the instruction began (compute: start; DMA: trigger start; sync: arrival)
    finish: list
    work_start: list     # start of its own work (sync: max arrival; DMA: issue start on its DGE / POOL)
    binder: list         # (instruction, release time) that determined the start, or None (time 0)
    end: float
    pipe_busy: list      # per rank: ns with at least one DMA in its data phase
    dur: list            # compute / sync duration at this band (incl. table loads)
    fences: list         # fence node index -> (core index, position, kind) (node = len(recs) + k)
    streams: list        # stream index -> (core index, name), incl. the band's trigger placement


class _Rank:
    """The data phase of a rank's DMAs: max-min fair rates under per-DMA, per-core and HBM caps."""
    __slots__ = ("bw", "active", "t", "version", "busy", "busy_since")

    def __init__(self, bw):
        self.bw = bw                # HBM bytes per ns
        self.active = {}            # idx -> [remaining payload B, rate, cap, inflation, hbm per payload B, core]
        self.t = 0.0
        self.version = 0
        self.busy = 0.0
        self.busy_since = None

    def advance(self, now):
        dt = now - self.t
        if dt > 0:
            for a in self.active.values():
                a[0] -= a[1] * dt
        self.t = now

    def rates(self):
        """Progressive filling: all unfrozen DMAs rise at the same payload rate until a cap binds."""
        act = self.active
        unfrozen = set(act)
        core_used = {}
        hbm_used = 0.0
        for a in act.values():
            a[1] = 0.0
        while unfrozen:
            lam = min(act[i][2] for i in unfrozen)
            which = ("cap", None)
            wsum = {}
            hsum = 0.0
            for i in unfrozen:
                a = act[i]
                wsum[a[5]] = wsum.get(a[5], 0.0) + a[3]
                hsum += a[4]
            for c, w in wsum.items():
                lc = (C.DMA_ENGINES_PER_CORE * C.DMA_ENGINE_BW - core_used.get(c, 0.0)) / w
                if lc < lam:
                    lam, which = lc, ("core", c)
            if hsum > 0:
                lh = (self.bw - hbm_used) / hsum
                if lh < lam:
                    lam, which = lh, ("hbm", None)
            lam = max(lam, 0.0)
            if which[0] == "cap":
                frozen = [i for i in unfrozen if act[i][2] <= lam * (1 + 1e-12)]
            elif which[0] == "core":
                frozen = [i for i in unfrozen if act[i][5] == which[1]]
            else:
                frozen = [i for i in unfrozen if act[i][4] > 0]
            for i in frozen:
                a = act[i]
                a[1] = lam
                core_used[a[5]] = core_used.get(a[5], 0.0) + lam * a[3]
                hbm_used += lam * a[4]
                unfrozen.discard(i)

    def next_done(self):
        best, who = _INF, None
        for i, a in self.active.items():
            if a[1] > 0:
                t = max(a[0], 0.0) / a[1]
                if t < best:
                    best, who = t, i
        return (self.t + best, who) if who is not None else (None, None)


def simulate(P: Program, params: costs.Params) -> Timeline:
    recs = P.recs
    n = len(recs)
    core = P.core
    # ---- fences of this band --------------------------------------------------------------------
    mode = params.loop_fences
    want = set() if mode == "none" else ({"iteration", "exit", "empty"} if mode == "iteration" else
                                         {"entry", "iteration", "exit", "empty"})
    fences = sorted({(ci, k) for ci, k, kd in P.boundaries if kd in want})
    nf = len(fences)
    N = n + nf
    kind = list(P.kind) + [K_FENCE] * nf
    # ---- streams of this band (DMA trigger placement) --------------------------------------------
    streams = list(P.streams)
    sid = {k: s for s, k in enumerate(streams)}
    stream = list(P.stream) + [-1] * nf
    trig_ns = {}
    is_pool = {}
    for i, (_, _, _, _, issue, rec) in P.dma.items():
        q = costs.dma_trigger(rec, params)
        if q == "none":
            continue
        key = (core[i], q)
        s = sid.get(key)
        if s is None:
            s = sid[key] = len(streams)
            streams.append(key)
        stream[i] = s
        pool = q == "POOL"
        is_pool[i] = pool
        trig_ns[i] = issue if pool else C.SP_INSTR_NS
    insts = [[] for _ in streams]
    for i in range(n):
        if stream[i] >= 0:
            insts[stream[i]].append(i)
    # ---- durations -------------------------------------------------------------------------------
    dur = [0.0] * N
    floor, thr = params.pe_floor_ns, params.pe_throttle
    base, is_pe, tload = P.base, P.is_pe, P.tload
    for i in range(n):
        k = kind[i]
        if k == K_COMPUTE:
            dur[i] = (max(floor, base[i]) * thr if is_pe[i] else base[i]) + tload[i]
        elif k == K_SYNC:
            dur[i] = costs.sync_ns(recs[i], P.n_ranks_total, params)
    # ---- graph: dependencies (+ hand-off) and fences ----------------------------------------------
    preds = [list(p) for p in P.preds] + [[] for _ in range(nf)]
    if nf:
        _wire_fences(P, fences, preds, n, want)
    succ = [[] for _ in range(N)]
    for i in range(N):
        for p in preds[i]:
            succ[p].append(i)
    h_cc, h_dma = params.handoff_ns, params.handoff_dma_ns

    def handoff(p, i):
        if i >= n:
            return 0.0
        if kind[i] == K_DMA:       # no semaphore when the producer is an earlier instruction of the DMA's own queue
            same = p < n and kind[p] != K_DMA and stream[p] >= 0 and stream[p] == stream[i]
            return 0.0 if same else h_dma
        return h_cc

    npred = [len(p) for p in preds]
    ready_t = [0.0] * N
    ready_by = [None] * N
    rdy = [False] * N
    start = [0.0] * N
    finish = [0.0] * N
    work_start = [0.0] * N
    binder = [None] * N
    ptr = [0] * len(streams)
    busy = [False] * len(streams)       # the stream's engine is executing (compute, sync, POOL descriptors)
    issuing = [False] * len(streams)    # its sequencer is issuing a DMA trigger
    prev_free = [(None, 0.0)] * len(streams)
    dge = [[(0.0, None)] * C.DMA_DGE_PER_CORE for _ in P.cores]
    nranks = (max(P.rank) + 1) if n else 1
    pipes = [_Rank(params.hbm_bw_per_rank / 1e9) for _ in range(nranks)]
    queue_head = [None] * len(streams)  # per trigger queue: the DMA in its data phase (FIFO, module doc)
    queue_wait = [deque() for _ in streams]
    arrived = {}
    heap = []
    ctr = 0

    def push(t, ev, x):
        nonlocal ctr
        ctr += 1
        heapq.heappush(heap, (t, ctr, ev, x))

    def set_binder(i, now, extra=None):
        s = stream[i]
        cands = []
        if ready_by[i] is not None:
            cands.append((ready_by[i], ready_t[i]))
        if s >= 0 and prev_free[s][0] is not None:
            cands.append(prev_free[s])
        if extra is not None:
            cands.append(extra)
        if cands:
            binder[i] = max(cands, key=lambda c: c[1])

    def dispatch(i, now):
        k = kind[i]
        s = stream[i]
        start[i] = now
        set_binder(i, now)
        if k == K_FENCE:
            work_start[i] = now
            push(now, EV_FINISH, i)
            return
        if k == K_DMA:
            if s >= 0:
                issuing[s] = True
                if is_pool.get(i):
                    busy[s] = True
                push(now + trig_ns[i], EV_TRIG, i)
            else:
                trigger_done(i, now)
            return
        busy[s] = True
        advance(s, i, now)              # in-order issue: the queue's next instruction may be a DMA trigger
        if k == K_COMPUTE:
            work_start[i] = now
            push(now + dur[i], EV_FINISH, i)
        else:
            g = P.groups[i]
            lst = arrived.setdefault(g, [])
            lst.append((now, i))
            if len(lst) == len(P.group_members[g]):
                t_last, last = max(lst)
                endt = t_last + dur[i]
                for (_, m) in lst:
                    work_start[m] = t_last
                    if m != last:
                        binder[m] = (last, t_last)
                    push(endt, EV_FINISH, m)
                del arrived[g]

    def trigger_done(i, now):
        """The trigger left its queue: POOL wrote the descriptors (data phase next); HWDGE takes a DGE."""
        if is_pool.get(i):
            work_start[i] = start[i]
            enter_pipe(i, now)
            return
        slots = dge[core[i]]
        j = min(range(len(slots)), key=lambda x: slots[x][0])
        free, holder = slots[j]
        t0 = max(now, free)
        if t0 > now and holder is not None and (binder[i] is None or free > binder[i][1]):
            binder[i] = (holder, free)
        work_start[i] = t0
        t1 = t0 + P.dma[i][4]
        slots[j] = (t1, i)
        push(t1, EV_ISSUED, i)

    def enter_pipe(i, now):
        if P.dma[i][0] <= 0:
            push(now + C.DMA_COMPLETION_NS, EV_FINISH, i)
            return
        s = stream[i]
        if s >= 0:          # its DMA queue: in order behind the queue's earlier DMAs (module doc)
            if queue_head[s] is not None:
                queue_wait[s].append(i)
                return
            queue_head[s] = i
        start_data(i, now)

    def start_data(i, now):
        nb, hb, engines, run, _, _ = P.dma[i]
        infl = 1.0 + params.dma_descriptor_overhead_bytes / run
        cap = engines * C.DMA_ENGINE_BW / infl
        r = P.rank[i]
        pp = pipes[r]
        pp.advance(now)
        if pp.busy_since is None:
            pp.busy_since = now
        pp.active[i] = [float(nb), 0.0, cap, infl, hb / nb, core[i]]
        reschedule(pp, r)

    def reschedule(pp, r):
        pp.rates()
        pp.version += 1
        t, _ = pp.next_done()
        if t is not None:
            push(t, EV_PIPE, (r, pp.version))

    def try_start(i, now):
        if npred[i] or not rdy[i]:
            return
        s = stream[i]
        if s >= 0:
            if issuing[s] or insts[s][ptr[s]] != i:
                return
            if busy[s] and (kind[i] != K_DMA or is_pool.get(i)):
                return
        dispatch(i, now)

    def became_ready(j, now):
        if ready_t[j] > now:
            push(ready_t[j], EV_READY, j)
        else:
            rdy[j] = True
            try_start(j, now)

    def advance(s, i, now):
        """The queue issued i: its next instruction is at the head."""
        prev_free[s] = (i, now)
        ptr[s] += 1
        if ptr[s] < len(insts[s]):
            try_start(insts[s][ptr[s]], now)

    def engine_free(s, i, now):
        busy[s] = False
        prev_free[s] = (i, now)
        if ptr[s] < len(insts[s]):
            try_start(insts[s][ptr[s]], now)

    for i in range(N):
        if npred[i] == 0:
            rdy[i] = True
    for s in range(len(streams)):
        if insts[s]:
            try_start(insts[s][0], 0.0)
    for i in range(N):
        if npred[i] == 0 and stream[i] < 0:
            dispatch(i, 0.0)

    end = 0.0
    while heap:
        now, _, ev, x = heapq.heappop(heap)
        if ev == EV_PIPE:
            r, ver = x
            pp = pipes[r]
            if ver != pp.version:
                continue
            pp.advance(now)
            done = [i for i, a in pp.active.items() if a[0] <= 1e-3]
            if not done:
                _, who = pp.next_done()
                if who is not None:
                    done = [who]
            for i in done:
                del pp.active[i]
                push(now + C.DMA_COMPLETION_NS, EV_FINISH, i)
                s = stream[i]
                if s >= 0 and queue_head[s] == i:
                    queue_head[s] = None
                    if queue_wait[s]:
                        nxt = queue_wait[s].popleft()
                        queue_head[s] = nxt
                        if binder[nxt] is None or binder[nxt][1] < now:
                            binder[nxt] = (i, now)
                        start_data(nxt, now)
            if not pp.active and pp.busy_since is not None:
                pp.busy += now - pp.busy_since
                pp.busy_since = None
            reschedule(pp, r)
            continue
        if ev == EV_READY:
            rdy[x] = True
            try_start(x, now)
            continue
        if ev == EV_TRIG:
            i = x
            s = stream[i]
            issuing[s] = False
            if is_pool.get(i):
                busy[s] = False
            trigger_done(i, now)
            advance(s, i, now)
            continue
        if ev == EV_ISSUED:
            enter_pipe(x, now)
            continue
        # EV_FINISH
        i = x
        finish[i] = now
        if now > end:
            end = now
        s = stream[i]
        if s >= 0 and kind[i] != K_DMA:
            engine_free(s, i, now)
        for j in succ[i]:
            npred[j] -= 1
            t = now + handoff(i, j)
            if t >= ready_t[j]:
                ready_t[j] = t
                ready_by[j] = i
            if npred[j] == 0:
                became_ready(j, now)

    stuck = [s for s in range(len(streams)) if ptr[s] < len(insts[s])]
    if stuck:
        s = stuck[0]
        i = insts[s][ptr[s]]
        rec = recs[i]
        raise RuntimeError(f"costmodel: the timeline deadlocked: {len(stuck)} streams never finished; first: "
                           f"core {P.cores[streams[s][0]]} {streams[s][1]} at instruction {i} {rec['op']} "
                           f"({rec.get('loc')}), {npred[i]} unfinished dependencies"
                           + (", rendezvous group incomplete" if i in P.groups else ""))
    # the binder's release time is the producer's finish (the hand-off shows as the consumer's wait)
    for i in range(N):
        b = binder[i]
        if b is not None and b[0] is not None and b[0] == ready_by[i] and b[1] == ready_t[i]:
            binder[i] = (b[0], finish[b[0]])
    return Timeline(P, params, start, finish, work_start, binder, end, [p.busy for p in pipes], dur,
                    [(ci, k) for ci, k in fences], streams)


def _wire_fences(P, fences, preds, n, want):
    """Fence node n + f after position k of core ci. It waits for the loop work since the core's previous loop
    boundary of any kind (the last instruction of every stream and every DMA in between: a loop's own DMAs
    complete before anything after the boundary starts, the DMAs issued before the loop do not have to) and
    for the previous fence; the next instruction of every stream and every DMA up to the next fence wait for
    it. A fence that, among the boundary kinds ``want`` of the band, only closes 0-trip loops ("empty") has no
    loop work: it waits for the previous fence alone (the pre-loop work is not the loop's; the high end's entry
    fences wait for it)."""
    marks = {}
    kinds_at = {}
    for ci, k, kd in P.boundaries:
        marks.setdefault(ci, set()).add(k)
        kinds_at.setdefault((ci, k), set()).add(kd)
    by_core = {}
    for f, (ci, k) in enumerate(fences):
        by_core.setdefault(ci, []).append((k, n + f))
    kinds, stream = P.kind, P.stream
    for ci, fl in by_core.items():
        order = P.order[ci]
        bounds = sorted(marks.get(ci, ()))
        fl.sort()
        prev_node = None
        b = 0
        for idx, (k, node) in enumerate(fl):
            while b < len(bounds) and bounds[b] < k:
                b += 1
            lo = bounds[b - 1] if b > 0 else -1
            if kinds_at.get((ci, k), set()) & want == {"empty"}:
                lo = k          # only 0-trip loops end here: no loop work to wait for
            ps = set()
            last = {}
            for pos in range(lo + 1, k + 1):
                i = order[pos]
                if kinds[i] == K_DMA:
                    ps.add(i)
                else:
                    last[stream[i]] = i
            ps.update(last.values())
            if prev_node is not None:
                ps.add(prev_node)
            preds[node].extend(ps)
            nxt_k = fl[idx + 1][0] if idx + 1 < len(fl) else len(order) - 1
            seen = set()
            for pos in range(k + 1, nxt_k + 1):
                i = order[pos]
                if kinds[i] == K_DMA:
                    preds[i].append(node)
                elif stream[i] not in seen:
                    seen.add(stream[i])
                    preds[i].append(node)
            prev_node = node
