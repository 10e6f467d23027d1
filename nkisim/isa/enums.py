"""nki.isa enums (values from SDK-027 nki/api/nki/isa/__init__.py; ref §5.0)."""
from enum import Enum


class engine(Enum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(Enum):
    error = 0
    skip = 1


class matmul_perf_mode(Enum):
    none = "none"
    double_row = "double_row"


class nc_version(Enum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(Enum):
    dma = 1
    gpsimd_dma = 2


tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown
