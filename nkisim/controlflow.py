"""LNC-uniform runtime control flow: the runtime loops each core of a rank executes must be the same.

SDK ``nki/get-started/about/lnc.rst`` "Final Notes": "the Neuron SDK assumes that when running a kernel on multiple
cores, the program on each core is 'the same'. This means that each core is executing the same basic control flow
as the other cores ... if you use dynamic control flow, and this control-flow is different on the different cores,
then the behavior is undefined"; SDK-RN 0.3.0 Known Issues: "LNC2 requires identical control flow across cores ...
may deadlock or produce incorrect results. This constraint is not enforced at compile time."

Static (Python) control flow may differ between cores: it is resolved at specialization. What must agree is the
*runtime* control flow, i.e. the hardware loops: ``nl.fori_loop``, ``nl.while_loop``, ``nl.dynamic_range``. Each
core (program instance) keeps a log with one entry per runtime loop it executes, in execution order:
``[kind, site, depth, trips]`` (site = the kernel line that issued the loop, depth = number of enclosing runtime
loops, trips = trip count; for ``while_loop`` the iteration count, known when it ends). The logs of the cores of
one rank must be equal. An entry is compared with the other core's entry of the same index as soon as both exist
(the first divergence is refused where it happens), and the whole logs are compared when the launch ends (a loop
only one core runs). A deadlock whose cores' logs differ is reported as this divergence (its root cause).

Shape-only launches are checked the same way, with whatever register values the launch produces.
Switch: ``nkisim.hw.LNC_UNIFORM_CHECK`` ("error" by default, "off").
"""
import os

from . import hw
from .errors import NkiValidationError
from .site import kernel_site

RULE = "LNC-uniform control flow"
DOC = "SDK nki/get-started/about/lnc.rst 'Final Notes'"
WINDOW = 6          # log entries shown on each side of the first difference


def enter(inst, kind, trips):
    """Log a runtime loop ``kind`` (``"fori_loop"``, ...) that ``inst`` starts; ``trips`` None when not yet known
    (while_loop). Returns the entry (give it to :func:`finish` for a while_loop), or None when not checked."""
    launch = inst.launch
    if launch.lnc < 2 or hw.LNC_UNIFORM_CHECK == "off":
        return None
    log = inst.loop_log
    entry = [kind, kernel_site(), len(inst.loops), trips]
    log.append(entry)
    _compare_at(inst, len(log) - 1)
    return entry


def finish(inst, entry, trips):
    """A while_loop ended after ``trips`` iterations: complete its entry and compare it again."""
    if entry is None:
        return
    entry[3] = trips
    log = inst.loop_log
    for k in range(len(log) - 1, -1, -1):
        if log[k] is entry:
            _compare_at(inst, k)
            return


def _compare_at(inst, k):
    mine = inst.loop_log[k]
    for other in inst.launch.instances:
        if other is inst or len(other.loop_log) <= k:
            continue
        theirs = other.loop_log[k]
        if mine[:3] != theirs[:3] or (mine[3] is not None and theirs[3] is not None and mine[3] != theirs[3]):
            raise NkiValidationError(message(inst.launch, k))


def divergence(launch):
    """The refusal message when the cores of ``launch`` (one rank) ran different runtime loops, else None."""
    if launch.lnc < 2 or hw.LNC_UNIFORM_CHECK == "off":
        return None
    logs = [i.loop_log for i in launch.instances]
    n = max(len(g) for g in logs)
    for k in range(n):
        rows = [tuple(g[k]) if k < len(g) else None for g in logs]
        if any(r != rows[0] for r in rows[1:]):
            return message(launch, k)
    return None


def check_world(world):
    """Raise the LNC-uniformity refusal for the first rank whose cores' logs differ (end of a launch)."""
    for launch in world.ranks:
        msg = divergence(launch)
        if msg is not None:
            raise NkiValidationError(msg)


def _fmt(e):
    kind, site, depth, trips = e
    where = "?" if site is None else f"{os.path.basename(site[0])}:{site[1]}"
    n = "? (still running)" if trips is None else trips
    return f"{kind} at {where} (depth {depth}, {n} trips)"


def _sequence(log, k):
    lo, hi = max(0, k - WINDOW), min(len(log), k + WINDOW + 1)
    lines = [f"      #{j}: {_fmt(log[j])}" + ("   <-- first difference" if j == k else "") for j in range(lo, hi)]
    if lo:
        lines.insert(0, f"      ... {lo} earlier identical loop(s)")
    if hi < len(log):
        lines.append(f"      ... {len(log) - hi} more")
    if k >= len(log):
        lines.append(f"      #{k}: (no runtime loop: this core ran only {len(log)})   <-- first difference")
    return lines


def message(launch, k):
    world = launch.world
    rank = f"rank {launch.rank}: " if world.tp > 1 else ""
    lines = [f"{RULE}: {rank}the cores of an LNC={launch.lnc} kernel ran different runtime loops (first difference at "
             f"runtime loop #{k}). Both cores must run the same dynamic control flow -- the same nl.fori_loop / "
             f"nl.while_loop / nl.dynamic_range loops at the same lines, with the same trip counts and nesting; "
             f"static Python differences between cores are fine ({DOC}: otherwise 'the behavior is undefined'; "
             f"SDK-RN 0.3.0: 'may deadlock or produce incorrect results'). Give every core the same trip counts (e.g. "
             f"bounds both cores load from the same values) and select per-core work inside the body."]
    for i in launch.instances:
        log = i.loop_log
        here = _fmt(log[k]) if k < len(log) else "no runtime loop"
        lines.append(f"  core {i.pid}: {here}; its runtime loops ({len(log)} in all):")
        lines.extend(_sequence(log, k))
    return "\n".join(lines)
