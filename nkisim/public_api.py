"""The public interface of the NKI 0.6 API, as names: what kernel code may read from the API modules and from
API objects (rule "undocumented attributes of API objects", nkisim/frontend.py).

Derived from the project's ../shared/docs/nki-api-0.6.json (aws-neuron/aws-neuron-sdk nki/api stubs at 81ce03a, Neuron
SDK 2.32 / NKI 0.6.0): module-level functions, enums, classes and constants, and the methods / attributes of each
public class. tests/nkisim/test_frontend_rules.py checks this module against that file."""

MODULES = {
    "nki": frozenset((
        'jit', 'simulate')),
    "nki.isa": frozenset((
        'NkiInstruction', 'NkiValidationError', 'VirtualRegister', 'activate2', 'activation', 'activation_reduce',
        'affine_select', 'bn_aggr', 'bn_stats', 'core_barrier', 'dge_mode', 'dma_compute', 'dma_copy', 'dma_engine',
        'dma_transpose', 'dropout', 'engine', 'exponential', 'get_nc_sub_version', 'get_nc_version',
        'gpsimd_engine', 'iota', 'local_gather', 'matmul_perf_mode', 'max8', 'memset', 'nc_find_index8',
        'nc_match_replace8', 'nc_matmul', 'nc_matmul_mx', 'nc_n_gather', 'nc_stream_shuffle', 'nc_transpose',
        'nc_version', 'nonzero_with_count', 'oob_mode', 'quantize_mx', 'rand2', 'rand_get_state', 'rand_set_state',
        'range_select', 'reciprocal', 'reduce_cmd', 'register_alloc', 'register_load', 'register_move',
        'register_store', 'rng', 'scalar_engine', 'scalar_tensor_tensor', 'select_reduce', 'sendrecv',
        'sequence_bounds', 'set_rng_seed', 'tensor_copy', 'tensor_copy_predicated', 'tensor_engine',
        'tensor_partition_reduce', 'tensor_reduce', 'tensor_scalar', 'tensor_scalar_cumulative',
        'tensor_scalar_reduce', 'tensor_tensor', 'tensor_tensor_scan', 'topk', 'unknown_engine', 'vector_engine')),
    "nki.language": frozenset((
        'DType', 'MemoryRegion', 'NKIObject', 'NkiTensor', '_TileSize', 'abs', 'abs_max', 'abs_min', 'add',
        'affine_range', 'all', 'arctan', 'average', 'bfloat16', 'bitwise_and', 'bitwise_or', 'bitwise_xor', 'bool_',
        'broadcast_to', 'bypass', 'ceil', 'copy', 'cos', 'device_print', 'divide', 'dropout', 'ds', 'dynamic_range',
        'empty_like', 'equal', 'erf', 'erf_dx', 'exp', 'expand_dims', 'float16', 'float32', 'float4_e2m1fn_x4',
        'float8_e4m3', 'float8_e4m3fn', 'float8_e4m3fn_x4', 'float8_e5m2', 'float8_e5m2_x4', 'float8_e8m0fnu',
        'floor', 'fmod', 'fori_loop', 'full', 'gather_flattened', 'gelu', 'gelu_apprx_sigmoid',
        'gelu_apprx_sigmoid_dx', 'gelu_apprx_tanh', 'gelu_dx', 'greater', 'greater_equal', 'hbm', 'int16', 'int32',
        'int8', 'invert', 'is_hbm', 'is_on_chip', 'is_psum', 'is_sbuf', 'left_shift', 'less', 'less_equal', 'load',
        'load_transpose2d', 'log', 'logical_and', 'logical_not', 'logical_or', 'logical_xor', 'matmul', 'max',
        'maximum', 'mean', 'min', 'minimum', 'mish', 'mod', 'multiply', 'ndarray', 'negative', 'no_reorder',
        'not_equal', 'num_programs', 'ones', 'power', 'prelu', 'private_hbm', 'prod', 'program_id', 'program_ndim',
        'psum', 'rand', 'random_seed', 'reciprocal', 'relu', 'right_shift', 'rms_norm', 'rsqrt', 'sbuf',
        'sequential_range', 'shared_constant', 'shared_hbm', 'shared_identity_matrix', 'sigmoid', 'sign', 'silu',
        'silu_dx', 'sin', 'softmax', 'softplus', 'sqrt', 'square', 'static_range', 'store', 'subtract', 'sum',
        'tan', 'tanh', 'tfloat32', 'tile_size', 'transpose', 'trunc', 'uint16', 'uint32', 'uint8', 'var', 'where',
        'while_loop', 'zeros', 'zeros_like')),
    # not in the stubs: the real package's module of the instruction enums (nki-library imports it; isa/constants.py)
    "nki.isa.constants": frozenset(('dge_mode', 'dma_engine', 'engine', 'matmul_perf_mode', 'nc_version', 'oob_mode',
                                    'reduce_cmd')),
    "nki.collectives": frozenset((
        'ReplicaGroup', 'all_gather', 'all_gather_v', 'all_reduce', 'all_to_all', 'all_to_all_v',
        'collective_permute', 'collective_permute_implicit',
        'collective_permute_implicit_current_processing_rank_id', 'collective_permute_implicit_reduce', 'rank_id',
        'reduce_scatter')),
}

# public members of the API classes (methods and attributes); dunders other than these are not public either
CLASSES = {
    "nki.isa.NkiInstruction": frozenset(('__init__', 'depends_on')),
    "nki.isa.NkiValidationError": frozenset(()),
    "nki.isa.VirtualRegister": frozenset(('__init__',)),
    "nki.language.NKIObject": frozenset(('__init__',)),
    "nki.language.NkiTensor": frozenset((
        '__getitem__', '__init__', '__setitem__', 'ap', 'broadcast', 'buffer', 'dtype', 'expand_dim',
        'flatten_dims', 'get_pattern', 'indirect', 'is_contiguous', 'is_indirect', 'name', 'ndim', 'offset',
        'permute', 'rearrange', 'reshape', 'reshape_dim', 'select', 'shape', 'size', 'slice', 'squeeze_dim',
        'strides', 'vector_select', 'view')),
    "nki.language._TileSize": frozenset((
        'bn_stats_fmax', 'gemm_moving_fmax', 'gemm_stationary_fmax', 'pmax', 'psum_bank_fmax',
        'psum_bank_fmax_bytes', 'psum_fmax', 'psum_min_align', 'psum_num_banks', 'sbuf_fmax', 'sbuf_fmax_bytes',
        'sbuf_min_align', 'sbuf_size_bytes', 'total_available_sbuf_size')),
    "nki.collectives.ReplicaGroup": frozenset(()),
}

# enum members (SDK-ISA / SDK-NL enums)
ENUMS = {
    "nki.isa.engine": frozenset(('tensor', 'vector', 'scalar', 'gpsimd', 'dma', 'sync', 'unknown')),
    "nki.isa.reduce_cmd": frozenset(('idle', 'reset', 'reduce', 'reset_reduce', 'load_reduce')),
    "nki.isa.dge_mode": frozenset(('unknown', 'swdge', 'hwdge', 'none')),
    "nki.isa.oob_mode": frozenset(('error', 'skip')),
    "nki.isa.matmul_perf_mode": frozenset(('none', 'double_row')),
    "nki.isa.nc_version": frozenset(('gen2', 'gen3', 'gen4')),
    "nki.isa.dma_engine": frozenset(('dma', 'gpsimd_dma')),
    "nki.language.MemoryRegion": frozenset(('sbuf', 'psum', 'private_hbm', 'shared_hbm')),
}

# Names outside the stubs that AWS's hardware-tested nki-library relies on: provided, with a NkiFidelityWarning when
# read (the name exists in the real package, but its meaning is not documented). name -> (value's source, evidence).
UNDOCUMENTED = {
    "nki.dtype": (
        "nki.language.DType (the stubs' dtype type: 'DType = str')",
        "AWS's nki-library annotates dtype parameters and results with it in 13 files since its first public "
        "release (2.27; the 2.29 release = NKI 0.3.0, compiled and run on hardware), e.g. core/subkernels/"
        "find_nonzero_indices.py 'index_dtype: nki.dtype = nl.int32'; the Neuron SDK's nki-library API pages show "
        "it as a parameter type ('compute_dtype: nki.dtype = nl.bfloat16'). Annotations are evaluated when a module "
        "is imported, so the real 'nki' package must have it"),
}
_warned = set()


def nki_package_getattr(name):
    """``__getattr__`` of nkisim's ``nki`` package (PEP 562): the UNDOCUMENTED names, each warned once."""
    key = f"nki.{name}"
    if key not in UNDOCUMENTED:
        raise AttributeError(f"module 'nki' has no attribute '{name}' (not in the NKI 0.6 public interface, "
                             f"../shared/docs/nki-api-0.6.json)")
    if key not in _warned:
        import warnings
        from .errors import NkiFidelityWarning
        _warned.add(key)
        source, evidence = UNDOCUMENTED[key]
        warnings.warn(f"{key} is not in the NKI 0.6 public interface (../shared/docs/nki-api-0.6.json); nkisim "
                      f"provides it as {source} because {evidence}", NkiFidelityWarning, stacklevel=2)
    from . import dtypes
    return dtypes.DType
