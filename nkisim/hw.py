"""Trainium2 (NeuronCore-v3) hardware limits: the ONE home of every constant nkisim checks.

Sources are tags of ../shared/docs/nki-reference.md §0 (SDK-ISA = aws-neuron-sdk nki/api/nki/isa,
SDK-TILE = nki.language.tile_size.rst, SDK-ARCH / SDK-TRN2 = architecture guides, KLR = KLR Trace.lean).
"""

# --- partitions -----------------------------------------------------------------------------
PMAX = 128                      # partitions of SBUF and PSUM (SDK-TILE pmax, SDK-TILING)

# --- SBUF -----------------------------------------------------------------------------------
SBUF_PARTITION_BYTES_PHYSICAL = 224 * 1024   # 28 MiB / 128 partitions (SDK-TRN2)
SBUF_PARTITION_BYTES = 212_984               # usable per partition on gen3 (KLR Trace.lean; ref §4)
SBUF_MIN_ALIGN = 1                           # bytes (KLR sbuf_min_align)

# --- PSUM -----------------------------------------------------------------------------------
PSUM_NUM_BANKS = 8                           # SDK-TILE psum_num_banks, SDK-ARCH
PSUM_BANK_BYTES = 2048                       # per partition per bank (SDK-TILE psum_bank_fmax_bytes)
PSUM_BANK_FMAX = 512                         # fp32 elements per bank (SDK-TILE psum_bank_fmax)
PSUM_PARTITION_BYTES = PSUM_NUM_BANKS * PSUM_BANK_BYTES   # 16 KiB (SDK-ARCH: 2 MiB / 128)
PSUM_MIN_ALIGN = 4                           # bytes (KLR psum_min_align)

# --- HBM ------------------------------------------------------------------------------------
# trn2: 96 GiB in 4 stacks; each stack shared by the 2 physical cores of one LNC=2 rank (SDK-TRN2).
HBM_BYTES_PER_RANK = 24 * 1024 ** 3

# --- TensorE (nc_matmul / nc_transpose) ------------------------------------------------------
GEMM_STATIONARY_FMAX = 128                   # M <= 128 (SDK-TILE gemm_stationary_fmax, SDK-ISA nc_matmul)
GEMM_MOVING_FMAX = 512                       # N <= 512 on v2/v3 (SDK-TILE gemm_moving_fmax)
GEMM_CONTRACT_MAX = 128                      # K <= 128 = partition dim (SDK-ISA nc_matmul)
PE_TRANSPOSE_MAX = 128                       # nc_transpose engine=tensor: <= [128, 128] (SDK-ISA)
DVE_TRANSPOSE_MAX = 32                       # nc_transpose engine=vector: <= [32, 32] (SDK-ISA)

# --- Vector / GpSimd ------------------------------------------------------------------------
BN_STATS_FMAX = 512                          # SDK-TILE bn_stats_fmax
MAX8_MIN_ELEMS = 8                           # max8 / nc_find_index8: 8 .. 16384 per partition (SDK-ISA)
MAX8_MAX_ELEMS = 16384
AP_MAX_FREE_DIMS = 4                         # engine access patterns: <= 4 free dims (SDK-ARCH, SDK-AP)
AP_MAX_DIM_SIZE = 65535                      # per-dim size is uint16 (SDK-ARCH)
AP_MAX_STRIDE = 32767                        # per-dim stride is int16, in elements (SDK-ARCH)
# Free dims of a compute-engine (PE / ACT / DVE / POOL) operand, counted after merging (isa/common.engine_free_pattern):
# SDK-AP "Hardware Capability": "the tensor read/write logic on the NeuronCore supports accessing elements from up to
# four-dimensional arrays, though most instructions only support 1D/2D/3D in the free dimension due to instruction
# length limitations"; SDK-ARCH: "up to four-dimensional tensorized access pattern". More than AP_MAX_FREE_DIMS cannot
# arrive (VIEW_MAX_DIMS below); more than AP_COMMON_FREE_DIMS is AP_FOUR_FREE_DIMS ("error", "warn" or "off") unless the
# instruction is documented to take four (isa/common._AP_FOUR_FREE). The docs do not name the "most" instructions,
# hence a switch.
AP_COMMON_FREE_DIMS = 3
AP_FOUR_FREE_DIMS = "warn"
# Dims of an on-chip view (nl.ndarray, reshape, expand_dim, rearrange): SDK-LG "Tensor Values", a view is "a strided
# access pattern with up to 5 dimensions" (partition + AP_MAX_FREE_DIMS).
VIEW_MAX_DIMS = 5
# Free elements per partition one VectorE / ScalarE / GpSimd instruction may access: "up to 64K elements for SBUF or
# 4K elements for PSUM" (SDK nki/guides/architecture/trainium_inferentia2_arch.rst, VectorE and ScalarE "Layout &
# Tile Size"; GpSimd ASSUMED the same). The SDK tiling overview's Tile-Size Constraint #2 (PSUM tiles F <= 512) reads
# as stricter; the engine sections are the specific statement, so reads spanning PSUM banks are accepted.
ENGINE_SBUF_FMAX = 65536
ENGINE_PSUM_FMAX = 4096
# tensor_tensor on GpSimd with floating-point operands (not op=nl.power): "error" (default), "warn" or "off". Ref §5.0's
# engine map gives GpSimd tensor_tensor only with int32/uint32 operands or op=nl.power, and the seed's hardware runs
# met "tensor_tensor cannot run on Pool" (shared/docs/trn2-costs.md, "Pitfalls met on real hardware"); the SDK-ISA
# docstring lists engine=gpsimd without the restriction. When in doubt, refuse.
POOL_FLOAT_TENSOR_TENSOR = "error"
# tensor_tensor on GpSimd with a bitvec operator (bitwise_and / _or / _xor, shifts): "error" (default), "warn" or "off".
# The SDK-ISA tensor_tensor docstring: "For bitvec operators, the input/output data types must be integer types and
# Vector Engine treats all input elements as bit patterns"; int32/uint32 tiles go to GpSimd only for arithmetic
# operators ("native integer arithmetic"); the 2.23 release notes add GpSimd "add, multiply in 32bit integer";
# tensor_scalar: "If bitvec operators are used, the tensor_scalar instruction must run on Vector Engine". No source
# runs a bitvec op on GpSimd, so nkisim refuses it and routes the int32 default of a bitvec op to VectorE.
POOL_BITVEC_TENSOR_TENSOR = "error"
# An SBUF -> SBUF dma_copy whose source and destination span different partition counts (e.g. [T, 1] -> [1, T]):
# "error" (default), "warn" or "off". shared/docs/trn2-costs.md, "Pitfalls met on real hardware": "`dma_copy` needs
# equal partition counts src/dst; SBUF APs cannot fold partitions into a row." (the SDK only requires equal element
# counts). Move through an HBM scratch, or transpose on the PE, instead.
DMA_SBUF_PARTITION_FOLD = "error"
# LNC=2: a core's read of shared-HBM bytes the other core wrote in the same launch needs a core_barrier on that tensor
# between them (nkisim.hbm_order; SDK nki.isa.core_barrier): "error", "warn" or "off". For scratch the kernel
# allocates, such a read can only see the other core's data or garbage: "error". For the kernel's HBM arguments the
# reader may be reading old contents on purpose and discarding them (the decode attention's masked head tiles read
# cache rows the other core is writing): "warn".
CORE_BARRIER_ORDER = "error"
CORE_BARRIER_ORDER_ARGUMENTS = "warn"
# A dma_copy gather / scatter by vector_offset whose on-chip side starts at another partition than its index tile:
# "error" (default), "warn" or "off". SDK-ISA dma_copy, "Vector indirection": "Each of the hardware partitions gets
# its own index ... an SBUF tensor of shape (P, 1) containing one row index per partition": documented only with the
# index tile aligned with the partitions it addresses; which index a partition reads otherwise is not said. When in
# doubt, refuse: one index row goes through "Scalar indirection" (a 1x1 SBUF scalar_offset) into any partition.
DMA_VECTOR_OFFSET_ALIGN = "error"

# --- start-partition rule (SDK-ARCH "Accessing SBUF/PSUM tensors using compute engines") ------
# n partitions in (64, 128] must start at 0; (32, 64] at 0 or 64; (0, 32] at 0/32/64/96.
# Documented for NeuronCore-v2 and repeated for nc_stream_shuffle in the current SDK-ISA; whether
# v3 relaxes it is an open question (ref §12), so it is enforced but can be switched off here.
ENFORCE_START_PARTITION = True

# --- runtime loops ----------------------------------------------------------------------------
# Any instruction (every engine) inside a runtime loop (nl.fori_loop / while_loop / dynamic_range) that writes a PSUM
# tensor allocated outside that loop: "error" (refused; default), "warn" (NkiFidelityWarning, once per call site) or
# "off". SDK-NL fori_loop / while_loop: "carry any other loop state through SBUF/HBM"; see isa/common.py
# _loop_psum_check.
LOOP_PSUM_CHECK = "error"
# A PSUM tensor whose value is live across a runtime-loop boundary (written before a loop and read or accumulated
# inside or after it): "warn" (default: only third-party evidence, see isa/common.py _psum_live_check), "error", "off".
LOOP_PSUM_LIVE = "warn"
# LNC=2: both cores of a rank run the same runtime loops (SDK lnc.rst "Final Notes"; nkisim/controlflow.py):
# "error" (default) or "off".
LNC_UNIFORM_CHECK = "error"

# --- Python forms the NKI 0.6 front end (KLR) refuses (nkisim/frontend.py klr_forms) -----------------------------
# In every traced function: a for-loop target that is not a single name (`for a, b in ...`), a tuple assignment target
# holding an attribute / subscript (`self.a, self.b = x, y`), a chained assignment with more than one attribute /
# subscript target (`self.a = self.b = None`), `enumerate(...)` / `zip(...)`, and `for` / `while` with an `else`.
# Evidence: the open-source KLR front end (leanprover/KLR, KLR/NKI/Simplify.lean: forLoop l.372 simpleVar "expecting
# simple variable", pattern / letSet l.299-316 "mutating assignments must be in separate statements", l.370 / l.380
# "for-orelse" / "while-orelse is not supported in NKI"; KLR/Trace/Python.lean l.79-388, the builtin.python functions,
# has no enumerate / zip) and AWS's hardware-tested nki-library, whose kernel code uses none of them. The SDK's
# language guide iterates a dict as `for k in d.keys(): v = d[k]`, but its overview page (get-started/about/index.rst
# l.427) writes `for k, v in d.items()`; KLR's public snapshot may predate 0.6. Third-party evidence: "warn"
# (NkiFrontendWarning, once per site; default), "error" or "off".
KLR_FORMS = "warn"

# --- 32-bit integers (SDK language guide "NKI Values": "32-bit integer values"; nkisim/int32.py) ---------------
INT32_MIN = -2 ** 31
INT32_MAX = 2 ** 31 - 1
INT32_CHECK = "error"        # "error" (default) or "off"


def legal_start_partitions(n):
    if n > 64:
        return (0,)
    if n > 32:
        return (0, 64)
    return (0, 32, 64, 96)


# --- registers / LNC ------------------------------------------------------------------------
NUM_REGISTERS = 64                           # 32-bit registers per engine sequencer (SDK-ISA register_alloc)
LNC_DEGREES = (1, 2)                         # kernel[lnc] on trn2 (SDK-LNC)
PHYSICAL_CORES_PER_CHIP = 8                  # 8 NeuronCore-v3 per Trainium2 chip; LNC=2 -> 4 ranks (SDK-TRN2)
NC_VERSION = "gen3"                          # trn2 (SDK-ISA nc_version)

# --- uninitialized memory sentinel (SDK-SIM: the official simulator fills NaN / 4) ---------
INT_SENTINEL = 4
