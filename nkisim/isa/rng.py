"""Pseudo-random number instructions: rng, dropout, set_rng_seed, rand_set_state, rand_get_state
(SDK-ISA 0.6, pages nki.isa.rng / nki.isa.dropout / nki.isa.set_rng_seed / nki.isa.rand_set_state /
nki.isa.rand_get_state; ref §5.7). ``rand2`` is NeuronCore-v4 only and stays refused (ref §5.13).

Fidelity stance
---------------
The documentation says the engines run an XORWOW generator per compute lane (SDK-ISA rand2: "Uses XORWOW PRNG
algorithm"; rand_set_state / rand_get_state: "element count for XORWOW must be 6 elements (GpSimd) or 24
elements (Vector)", one partition per compute lane). It does not document the order of the state words, how
``set_rng_seed`` expands one 32-bit seed into lane states, the power-on state, or how the Vector engine's 24
words per lane are used. nkisim therefore runs a real XORWOW generator per lane with the choices below; its
numbers are **not** the numbers trn2 produces (bit-identical results are impossible without the undocumented
details), but the distribution, the determinism for a given seed, the state round trip and every documented
shape / dtype / engine / memory rule are as documented.

Model (nkisim's choices, documented here and in nkisim/README.md):

* One generator state per **physical core** (program instance) and engine, created fresh at every launch.
  GpSimd (POOL): 128 lanes x one XORWOW stream (6 uint32 words). Vector (DVE): 128 lanes x four interleaved
  XORWOW streams (4 x 6 = 24 uint32 words, the documented Vector state size).
* XORWOW (Marsaglia 2003, "Xorshift RNGs", the xorwow variant): words ``[x, y, z, w, v, d]``; one step is
  ``t = x ^ (x >> 2); x, y, z, w = y, z, w, v; v = (v ^ (v << 4)) ^ (t ^ (t << 1)); d += 362437`` and yields
  ``v + d`` (mod 2**32). ``rand_get_state`` / ``rand_set_state`` move these 6 words per lane verbatim (in that
  order), so get -> set reproduces the continuation exactly.
* Lane ``L`` = absolute SBUF/PSUM partition of the operand row (SDK-ISA rand_set_state: "Each partition in the
  source tensor seeds the PRNG states for the corresponding compute lane"). Within one instruction the free
  elements of a partition (row-major over the view's free dims) are that lane's successive draws: GpSimd,
  element j = draw j of the lane's stream (so splitting a request over several calls continues the same
  stream, which aws-neuron/nki-library experimental/rng/rng.py relies on); Vector, element j = draw ``j // 4``
  of sub-stream ``j % 4``.
* ``set_rng_seed`` and the launch-start state expand one 32-bit value into distinct per-lane states with a
  fixed integer hash (launch start = seed 0, with a different salt per engine). On hardware the power-on state
  is undocumented (NKL re-seeds each lane before use); seed explicitly if it matters.
* ``dropout`` (Vector) draws one 32-bit value per element from the Vector PRNG (so it advances the state
  ``nl.rand`` / ``rng(engine=vector)`` use) and drops the element iff ``(bits >> 8) * 2**-24 < prob``.
"""
import numpy as np

from .. import dtypes, hw
from ..errors import NkiValidationError
from ..memory import ON_CHIP, PSUM, SBUF
from ..tensor import NkiTensor
from .common import REACH, Instruction, check_enum, geom, is_scalar, match, read, read_raw, record, tensor, write
from .enums import engine as E

RNG_DTYPES = ("int8", "int16", "int32", "uint8", "uint16", "uint32")     # SDK-ISA rng "Data types"
STATE_WORDS = {"POOL": 6, "DVE": 24}                                     # SDK-ISA rand_set_state "Tile size"
STREAMS_PER_LANE = {"POOL": 1, "DVE": 4}
SEED_DTYPES = ("int32", "uint32", "float32")                             # SDK-ISA set_rng_seed: "a 32-bit value"
_WEYL = 362437
_M32 = 0xFFFFFFFF
_SALT = {"POOL": 0x5CA1AB1E, "DVE": 0x0DDBA11}


# ---- the generator ---------------------------------------------------------------------------
def xorwow(state, n):
    """Advance every stream (the columns of ``state``, a (6, S) uint32 array ``[x, y, z, w, v, d]``) ``n``
    steps in place and return the (S, n) uint32 outputs ``v + d`` of those steps."""
    S = state.shape[1]
    if n <= 0:
        return np.empty((S, 0), np.uint32)
    x, y, z, w, v = (state[i].copy() for i in range(5))
    vs = np.empty((n, S), np.uint32)
    for j in range(n):
        t = x ^ (x >> 2)
        x, y, z, w = y, z, w, v
        v = (v ^ (v << 4)) ^ (t ^ (t << 1))
        vs[j] = v
    steps = np.arange(1, n + 1, dtype=np.uint64)[:, None] * _WEYL
    ds = ((state[5].astype(np.uint64)[None, :] + steps) & _M32).astype(np.uint32)
    state[0], state[1], state[2], state[3], state[4], state[5] = x, y, z, w, v, ds[-1]
    return (vs + ds).T


def _mix32(z):
    """murmur3's 32-bit finaliser on uint64 arrays holding 32-bit values."""
    z = z & _M32
    z ^= z >> 16
    z = (z * 0x85EBCA6B) & _M32
    z ^= z >> 13
    z = (z * 0xC2B2AE35) & _M32
    z ^= z >> 16
    return z


def expand_seed(seed, streams, salt=0):
    """nkisim's expansion of one 32-bit seed into ``streams`` XORWOW states (6, streams): word i of the flat
    (stream-major) sequence is a hash of (seed, i). Deterministic; distinct seeds / lanes give distinct
    streams. (The hardware's expansion is undocumented.)"""
    i = np.arange(1, 6 * streams + 1, dtype=np.uint64)
    z = _mix32(np.uint64((int(seed) ^ salt) & _M32) + i * np.uint64(0x9E3779B9))
    z = _mix32(z + np.uint64(int(seed) & _M32) * np.uint64(0x632BE5AB))
    return z.astype(np.uint32).reshape(streams, 6).T.copy()


def engine_state(inst, eng):
    """The (6, 128 * streams-per-lane) XORWOW state of engine ``eng`` on this instance (created on first use
    as the launch-start state: seed 0 expanded with a per-engine salt)."""
    states = inst.__dict__.setdefault("rng_states", {})
    st = states.get(eng)
    if st is None:
        st = states[eng] = expand_seed(0, hw.PMAX * STREAMS_PER_LANE[eng], _SALT[eng])
    return st


def draw(inst, eng, start, P, F):
    """(P, F) uint32 random bits for lanes ``start .. start + P`` of engine ``eng`` (element order: module
    docstring), advancing the engine state."""
    st = engine_state(inst, eng)
    k = STREAMS_PER_LANE[eng]
    cols = slice(start * k, (start + P) * k)
    sub = st[:, cols].copy()
    if k == 1:
        out = xorwow(sub, F)
    else:
        m, r = divmod(F, k)
        out = np.empty((P, F), np.uint32)
        full = xorwow(sub, m)                                      # (P * k, m): stream 4p + s, draw i
        out[:, :m * k] = full.reshape(P, k, m).transpose(0, 2, 1).reshape(P, m * k)
        if r:
            idx = (np.arange(P)[:, None] * k + np.arange(r)[None, :]).reshape(-1)
            part = sub[:, idx].copy()
            out[:, m * k:] = xorwow(part, 1).reshape(P, r)
            sub[:, idx] = part
    st[:, cols] = sub
    return out


# ---- operand checks ----------------------------------------------------------------------------
def _engine(w, engine, default, allowed, why=""):
    check_enum(w, "engine", engine, E)
    if engine is E.unknown:
        return default
    eng = {E.vector: "DVE", E.gpsimd: "POOL"}.get(engine)
    if eng not in allowed:
        names = " or ".join({"DVE": "nki.isa.engine.vector", "POOL": "nki.isa.engine.gpsimd"}[a] for a in allowed)
        raise NkiValidationError(f"{w}: engine={engine} is not supported on trn2; expected {names} (or "
                                 f"nki.isa.engine.unknown){why}")
    return eng


def _state_tile(w, name, t):
    """A 2-D uint32 (P, 6) SBUF tile of GpSimd lane states; returns (start lane, P)."""
    tensor(w, name, t, (SBUF,), "POOL")
    start, P, F = geom(w, name, t)
    if t.dtype != "uint32":
        raise NkiValidationError(f"{w}: {name} must be uint32, got {t.dtype} (SDK-ISA {w} 'Data types')")
    if len(t.shape) != 2 or F != STATE_WORDS["POOL"]:
        raise NkiValidationError(f"{w}: {name} has shape {list(t.shape)}; expected a 2-D (lanes, "
                                 f"{STATE_WORDS['POOL']}) tensor: one partition per compute lane, the 6 XORWOW "
                                 f"state words of a GpSimd lane in the free dim (SDK-ISA {w} 'Tile size')")
    return start, P


_V3_STATE = ("; on NeuronCore-v3 (trn2) only the GpSimd PRNG state can be read or written, the Vector engine "
             "needs NeuronCore-v4+ (SDK-ISA rand_set_state / rand_get_state 'Supported engines')")


# ---- instructions ------------------------------------------------------------------------------
def rng(dst, engine=E.vector, name=None):
    """32 random bits per element, truncated to the integer dst type (least significant bits kept), from the
    Vector (default) or GpSimd PRNG (SDK-ISA nki.isa.rng). dst: int8/int16/int32/uint8/uint16/uint32, SBUF or
    PSUM (GpSimd: SBUF only), at most 128 partitions. ``engine=unknown`` picks Vector. Element order and the
    generator: module docstring (not bit-identical to trn2)."""
    w = "rng"
    eng = _engine(w, engine, "DVE", ("DVE", "POOL"))
    tensor(w, "dst", dst, REACH[eng], eng)
    start, P, F = geom(w, "dst", dst)
    if dst.dtype not in RNG_DTYPES:
        raise NkiValidationError(f"{w}: dst must be an integer type ({', '.join(RNG_DTYPES)}), got {dst.dtype} "
                                 f"(SDK-ISA rng 'Data types'; normalise the bits with tensor_scalar for floats)")
    inst = record(w, eng, writes=[("dst", dst)], rng={"engine": eng, "lanes": [start, P], "draws": F})
    if inst.shape_only:
        return Instruction(w)
    bits = draw(inst, eng, start, P, F)
    st = dtypes.storage(dst.dtype)
    v = bits.astype(np.dtype(f"uint{8 * st.itemsize}"))        # keep the least significant bits
    write(dst, v.view(st).reshape(dst.shape), exact=True)
    return Instruction(w)


def dropout(dst, data, prob, name=None):
    """Vector engine: each element of ``data`` is replaced by zero with probability ``prob`` and kept unchanged
    otherwise (no 1/(1-p) rescaling: SDK-ISA nki.isa.dropout describes replacement by zeros only; the same holds
    for nki.language.dropout). ``prob``: a Python scalar in [0, 1] or a (data.shape[0], 1) tile (one probability
    per partition; float32 when data is an integer type, any float type otherwise). ``dst.dtype`` must equal
    ``data.dtype``; kept elements are copied bit-exactly. Draws from the Vector PRNG (module docstring): element
    dropped iff ``(bits >> 8) * 2**-24 < prob`` (tile probabilities >= 1 drop all, <= 0 or NaN drop none)."""
    w = "dropout"
    for nm, t in (("dst", dst), ("data", data)):
        tensor(w, nm, t, ON_CHIP, "DVE")
    start, P, F = geom(w, "data", data)
    geom(w, "dst", dst)
    match(w, "dst", dst, "data", data)
    if dst.dtype != data.dtype:
        raise NkiValidationError(f"{w}: dst dtype {dst.dtype} must match data dtype {data.dtype} (SDK-ISA dropout)")
    if data.dtype in dtypes.PACKED:
        raise NkiValidationError(f"{w}: x4 packed data ({data.dtype}) is refused: nkisim does not model its dropout "
                                 f"(its bit layout is undocumented), so it cannot vouch for it")
    reads = [("data", data)]
    if isinstance(prob, NkiTensor):
        tensor(w, "prob", prob, ON_CHIP, "DVE")
        geom(w, "prob", prob)
        if prob.shape[0] != P or prob.size != P:
            raise NkiValidationError(f"{w}: prob tile has shape {list(prob.shape)}, expected ({P}, 1): one drop "
                                     f"probability per partition of data")
        if dtypes.is_int(data.dtype) and prob.dtype != "float32":
            raise NkiValidationError(f"{w}: data is {data.dtype} (an integer type), so prob must be float32, got "
                                     f"{prob.dtype} (SDK-ISA dropout)")
        if not dtypes.is_float(prob.dtype) or prob.dtype in dtypes.PACKED:
            raise NkiValidationError(f"{w}: prob tile must have a float dtype, got {prob.dtype} (SDK-ISA dropout)")
        if prob.buffer == PSUM and data.buffer == PSUM:
            raise NkiValidationError(f"{w}: data and prob are both in psum; at most one tensor input may be in PSUM "
                                     f"(ref §5.0)")
        reads.append(("prob", prob))
        pdesc = "tile"
    elif is_scalar(prob) and not isinstance(prob, (bool, np.bool_)):
        p = float(prob)
        if not 0.0 <= p <= 1.0:
            raise NkiValidationError(f"{w}: prob={prob!r} is not a probability; expected a value in [0, 1] "
                                     f"(SDK-ISA dropout: 1.0 drops all elements, 0.0 keeps all)")
        pdesc = p
    else:
        raise TypeError(f"{w}: prob must be a Python scalar or a ({P}, 1) tile, got {type(prob).__name__}")
    inst = record(w, "DVE", reads=reads, writes=[("dst", dst)], prob=pdesc,
                  rng={"engine": "DVE", "lanes": [start, P], "draws": F})
    if inst.shape_only:
        return Instruction(w)
    x = read_raw(w, "data", data)
    pv = read(w, "prob", prob).reshape(P, 1) if pdesc == "tile" else np.float32(pdesc)
    u = (draw(inst, "DVE", start, P, F) >> 8).astype(np.float32) * np.float32(2.0 ** -24)
    with np.errstate(invalid="ignore"):
        drop = u < pv
    out = np.where(drop, np.zeros((), x.dtype), x)
    write(dst, out.reshape(dst.shape), exact=True)
    return Instruction(w)


def set_rng_seed(src_seeds, name=None):
    """Seed the Vector engine PRNG from one 32-bit value (SDK-ISA nki.isa.set_rng_seed): ``src_seeds`` is a
    [1, 1] tensor in SBUF or PSUM of a 32-bit dtype (int32, uint32 or float32; its bit pattern is the seed).
    Every Vector lane gets a state expanded from the seed (nkisim's hash, module docstring), so the same seed
    reproduces the same ``rng`` / ``dropout`` / ``nl.rand`` numbers."""
    w = "set_rng_seed"
    tensor(w, "src_seeds", src_seeds, ON_CHIP, "DVE")
    geom(w, "src_seeds", src_seeds)
    if tuple(src_seeds.shape) != (1, 1):
        raise NkiValidationError(f"{w}: src_seeds must be a [1, 1] tensor, got {list(src_seeds.shape)} "
                                 f"(SDK-ISA set_rng_seed 'Tile size')")
    if src_seeds.dtype not in SEED_DTYPES:
        raise NkiValidationError(f"{w}: src_seeds must hold a 32-bit value ({', '.join(SEED_DTYPES)}), got "
                                 f"{src_seeds.dtype} (SDK-ISA set_rng_seed 'Data types')")
    inst = record(w, "DVE", reads=[("src_seeds", src_seeds)], rng={"engine": "DVE", "lanes": [0, hw.PMAX],
                                                                     "draws": 0})
    if inst.shape_only:
        return Instruction(w)
    raw = read_raw(w, "src_seeds", src_seeds).reshape(-1)
    seed = int(raw.view(np.uint32)[0])
    engine_state(inst, "DVE")[...] = expand_seed(seed, hw.PMAX * STREAMS_PER_LANE["DVE"], _SALT["DVE"] ^ 1)
    return Instruction(w)


def rand_set_state(src_seeds, engine=E.gpsimd, name=None):
    """Load the GpSimd PRNG state of the lanes covered by ``src_seeds`` verbatim (SDK-ISA
    nki.isa.rand_set_state): a 2-D uint32 (lanes, 6) SBUF tensor, partition p -> lane (start partition + p),
    words ``[x, y, z, w, v, d]`` (nkisim's order). Other lanes keep their state. trn2 (NeuronCore-v3) supports
    only the GpSimd engine here; ``engine=unknown`` picks it, ``engine=vector`` is refused."""
    w = "rand_set_state"
    _engine(w, engine, "POOL", ("POOL",), _V3_STATE)
    start, P = _state_tile(w, "src_seeds", src_seeds)
    inst = record(w, "POOL", reads=[("src_seeds", src_seeds)], rng={"engine": "POOL", "lanes": [start, P],
                                                                     "draws": 0})
    if inst.shape_only:
        return Instruction(w)
    words = read_raw(w, "src_seeds", src_seeds).reshape(P, 6).astype(np.uint32)
    engine_state(inst, "POOL")[:, start:start + P] = words.T
    return Instruction(w)


def rand_get_state(dst, engine=E.gpsimd, name=None):
    """Store the current GpSimd PRNG state of the lanes covered by ``dst`` (SDK-ISA nki.isa.rand_get_state):
    a 2-D uint32 (lanes, 6) SBUF tensor, same layout as rand_set_state (so get -> set round-trips exactly).
    trn2 supports only the GpSimd engine; ``engine=unknown`` picks it, ``engine=vector`` is refused."""
    w = "rand_get_state"
    _engine(w, engine, "POOL", ("POOL",), _V3_STATE)
    start, P = _state_tile(w, "dst", dst)
    inst = record(w, "POOL", writes=[("dst", dst)], rng={"engine": "POOL", "lanes": [start, P], "draws": 0})
    if inst.shape_only:
        return Instruction(w)
    words = engine_state(inst, "POOL")[:, start:start + P].T.copy()
    write(dst, words.reshape(dst.shape), exact=True)
    return Instruction(w)
