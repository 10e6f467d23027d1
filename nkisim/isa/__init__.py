"""nkisim implementation of ``nki.isa`` (NKI 0.6.0 signatures, SDK-ISA)."""
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
from .control import (core_barrier, get_nc_sub_version, get_nc_version, register_alloc, register_load, register_move,
                      register_store, sendrecv)


def _missing(name, why="not implemented by nkisim yet"):
    def f(*args, **kwargs):
        raise NotImplementedError(f"nisa.{name}: {why}")
    f.__name__ = name
    return f


_V4 = "NeuronCore-v4 (trn3) only; not available on trn2 (ref §5.13)"
nc_matmul_mx = _missing("nc_matmul_mx", _V4)
activate2 = _missing("activate2", _V4)
exponential = _missing("exponential", _V4 + "; use activation(op=nl.exp, bias=-max)")
quantize_mx = _missing("quantize_mx", _V4)
rand2 = _missing("rand2", _V4)
