"""Registers, cross-core synchronisation and target queries (ref §2.4, §5.9, §5.11)."""
import numpy as np

from .. import dtypes, hbm_order, hw
from ..errors import NkiValidationError
from ..memory import HBM, ON_CHIP, SBUF, SHARED_HBM
from ..registers import VirtualRegister, _scalar
from ..site import current
from ..tensor import NkiTensor
from .common import Instruction, check_enum, geom, match, read_raw, record, tensor, write
from .enums import dma_engine as DE, engine as E, nc_version


def get_nc_version():
    return nc_version.gen3


def get_nc_sub_version():
    return 0


def register_alloc(x=None):
    """A virtual register; at most hw.NUM_REGISTERS (64) may be live at once per instance (see VirtualRegister:
    a register is freed when its Python object goes away, as the compiler frees dead virtual registers)."""
    inst = current("register_alloc")
    if inst.live_registers >= hw.NUM_REGISTERS:
        raise NkiValidationError(f"register_alloc: {inst.live_registers + 1} registers live at once; an engine "
                                 f"sequencer has {hw.NUM_REGISTERS} (registers are virtual and freed when no longer "
                                 f"referenced: drop the ones you no longer need)")
    r = VirtualRegister(x)
    inst.live_registers += 1
    r.owner = inst
    return r


def _reg(op, name, r):
    if not isinstance(r, VirtualRegister):
        raise TypeError(f"{op}: {name} must be a VirtualRegister, got {type(r).__name__}")
    return r


def register_move(dst, src):
    op = "register_move"
    _reg(op, "dst", dst)
    if dst.frozen:
        raise NkiValidationError(f"{op}: dst is a read-only loop induction register")
    record(op, "SP", reg_reads=(src,), reg_writes=(dst,))
    dst.value = src.value if isinstance(src, VirtualRegister) else _scalar(src, op)
    dst.placeholder = isinstance(src, VirtualRegister) and src.placeholder
    return Instruction(op)


def _one(op, name, t):
    tensor(op, name, t, (SBUF,) + HBM)
    if t.size != 1:
        raise NkiValidationError(f"{op}: {name} must hold exactly one element ([1] or [1, 1]), got {list(t.shape)}")
    if t.itemsize > 4:
        raise NkiValidationError(f"{op}: {name} dtype {t.dtype} is wider than a 32-bit register")


def register_load(dst, src):
    op = "register_load"
    _reg(op, "dst", dst)
    _one(op, "src", src)
    if dst.frozen:
        raise NkiValidationError(f"{op}: dst is a read-only loop induction register")
    inst = record(op, "SP", reads=[("src", src)], reg_writes=(dst,))
    provider = inst.launch.world.register_values
    v = None
    if not inst.shape_only or src.storage.data is not None:     # executing, or a real integer input (shape-only)
        v = read_raw(op, "src", src, flat=False).reshape(-1)[0]
        v = float(v) if dtypes.is_float(src.dtype) else int(v)
    elif src.storage.known is not None:                         # shape-only: a DMA copy of a real integer input
        v = src.storage.known.get(src.boffset // src.itemsize)
    if provider is not None:
        got = provider(_query(inst, src, v))
        if v is None and got is not None:
            v = _scalar(got, f"{op} (register-value provider)")
    if v is None:
        dst.value, dst.placeholder = 0, True        # documented placeholder: data-dependent values read as 0
    else:
        dst.value, dst.placeholder = v, False
    return Instruction(op)


def _query(inst, src, value):
    from ..registers import RegisterLoad
    from ..site import kernel_stack
    loc, stack = kernel_stack()
    st = src.storage
    fn = stack[0].rsplit(":", 1)[-1] if stack else None
    return RegisterLoad(kernel=inst.launch.world.kernel_name, rank=inst.launch.rank, core=inst.pid, loc=loc,
                        stack=stack, function=fn, tensor=st.name, tensor_id=st.id, named=st.named,
                        memory=st.kind.value, index=src.boffset // src.itemsize, dtype=src.dtype, value=value)


def register_store(dst, src):
    op = "register_store"
    _one(op, "dst", dst)
    _reg(op, "src", src)
    inst = record(op, "SP", writes=[("dst", dst)], reg_reads=(src,))
    if inst.shape_only:
        return Instruction(op)
    write(dst, np.array([src.value]))
    return Instruction(op)


def core_barrier(data, cores, engine=E.gpsimd, name=None):
    op = "core_barrier"
    inst = current(op)
    launch = inst.launch
    if not isinstance(data, NkiTensor):
        raise TypeError(f"{op}: data must be the shared tensor being synchronised")
    cores = tuple(cores)
    if launch.lnc != 2 or sorted(cores) != [0, 1]:
        raise NkiValidationError(f"{op}: needs an LNC=2 launch (kernel[2]) and cores=(0, 1); got lnc={launch.lnc}, "
                                 f"cores={cores}")
    check_enum(op, "engine", engine, E)
    record(op, {E.gpsimd: "POOL", E.vector: "DVE", E.scalar: "ACT", E.tensor: "PE", E.sync: "SP"}.get(engine, "POOL"),
           reads=[("data", data)])
    world = launch.world
    with world.cond:
        gen = launch.barrier_gen
        launch.barrier_arrived[inst.pid] = gen
        launch.barrier_data[inst.pid] = data.storage
        if len(launch.barrier_arrived) == launch.lnc:
            named = list(launch.barrier_data.values())
            launch.barrier_arrived.clear()
            launch.barrier_data.clear()
            launch.barrier_gen += 1
            if not inst.shape_only:
                hbm_order.barrier(launch, named)
            return Instruction(op)

        def describe():
            miss = [i for i in launch.instances if i.pid not in launch.barrier_arrived]
            return (f"core_barrier (cores {list(cores)}) waits for " +
                    ", ".join(f"core {i.pid} ({world.status_of(i)})" for i in miss))
        world.block(inst, lambda: launch.barrier_gen > gen, describe)
    return Instruction(op)


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=DE.dma, name=None):
    """LNC=2 SBUF<->SBUF exchange: my src goes to the peer's dst, the peer's src into my dst."""
    op = "sendrecv"
    inst = current(op)
    launch = inst.launch
    tensor(op, "src", src, (SBUF,))
    tensor(op, "dst", dst, (SBUF,))
    check_enum(op, "dma_engine", dma_engine, DE)
    if launch.lnc != 2:
        raise NkiValidationError(f"{op}: needs an LNC=2 launch (kernel[2])")
    if {send_to_rank, recv_from_rank} - {0, 1} or send_to_rank == inst.pid:
        raise NkiValidationError(f"{op}: send_to_rank/recv_from_rank must name the other core (0 or 1), got "
                                 f"{send_to_rank}/{recv_from_rank} on core {inst.pid}")
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise NkiValidationError(f"{op}: src {src.describe()} and dst {dst.describe()} must have the same shape and dtype")
    if dma_engine == DE.gpsimd_dma:
        lim = {1: 256, 2: 512, 4: 1024}.get(src.itemsize, 1024)
        if src.size // src.shape[0] * src.itemsize > lim:
            raise NkiValidationError(f"{op}: gpsimd_dma moves at most {lim} B per partition for {src.dtype}")
    geom(op, "src", src, start_rule=False)
    geom(op, "dst", dst, start_rule=False)
    record(op, "DMA", reads=[("src", src)], writes=[("dst", dst)], pipe=pipe_id, peer=send_to_rank)
    key = pipe_id
    world = launch.world
    with world.cond:
        peer = launch.pipes.get(key)
        if peer is None:
            slot = {"pid": inst.pid, "src": src, "dst": dst, "done": False}
            launch.pipes[key] = slot
            other = launch.instances[1 - inst.pid]
            world.block(inst, lambda: slot["done"],
                        lambda: f"sendrecv pipe {pipe_id} waits for core {other.pid} ({world.status_of(other)})")
            return Instruction(op)
        del launch.pipes[key]
        if peer["src"].shape != src.shape or peer["src"].dtype != src.dtype:
            raise NkiValidationError(f"{op}: pipe {pipe_id}: peer sends {peer['src'].describe()} but this core "
                                     f"sends {src.describe()}")
        if not inst.shape_only:
            mine = read_raw(op, "src", src, flat=False).copy()
            theirs = read_raw(op, "peer src", peer["src"], flat=False).copy()
            write(dst, theirs, exact=True)
            write(peer["dst"], mine, exact=True)
        peer["done"] = True
    return Instruction(op)
