"""nkisim implementation of ``nki.isa`` (NKI 0.6.0 signatures, SDK-ISA)."""
import sys

from .. import frontend
from ..errors import NkiValidationError
from ..registers import VirtualRegister
from .common import Instruction as NkiInstruction
from .enums import (dge_mode, dma_engine, engine, gpsimd_engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd,
                    scalar_engine, tensor_engine, unknown_engine, vector_engine)
from .dma import dma_compute, dma_copy, dma_transpose
from .pe import nc_matmul, nc_transpose
from .act import activation, activation_reduce
from .dve import (max8, memset, nc_find_index8, nc_match_replace8, nc_stream_shuffle, reciprocal, scalar_tensor_tensor,
                  select_reduce, tensor_copy, tensor_copy_predicated, tensor_reduce, tensor_scalar, tensor_tensor)
from .accum import bn_aggr, bn_stats, range_select, tensor_scalar_cumulative, tensor_scalar_reduce, tensor_tensor_scan
from .pool import (affine_select, iota, local_gather, nc_n_gather, nonzero_with_count, sequence_bounds,
                   tensor_partition_reduce, topk)
from .rng import dropout, rand_get_state, rand_set_state, rng, set_rng_seed
from . import constants  # noqa: F401  (nki.isa.constants, see constants.py)
from .control import (core_barrier, get_nc_sub_version, get_nc_version, register_alloc, register_load, register_move,
                      register_store, sendrecv)


def _trn3_only(name, hint=""):
    """An op of NeuronCore-v4 (trn3) that a trn2 kernel cannot use: calling it is refused like any other rule the
    trn2 compiler enforces (ref §5.13; SDK-ISA docstrings name the architecture)."""
    def f(*args, **kwargs):
        raise NkiValidationError(f"nisa.{name}: NeuronCore-v4 (trn3) only; not available on trn2 (ref §5.13){hint}")
    f.__name__ = name
    f.trn3_only = True
    return f


nc_matmul_mx = _trn3_only("nc_matmul_mx")
activate2 = _trn3_only("activate2")
exponential = _trn3_only("exponential", "; use activation(op=nl.exp, bias=-max)")
quantize_mx = _trn3_only("quantize_mx")
rand2 = _trn3_only("rand2")


frontend.register_api_module(sys.modules[__name__], "nki.isa")
frontend.register_api_module(constants, "nki.isa.constants")
