"""What every kernel shares (traced code, written in the NKI Python subset): the trn2 tile sizes as Python ints,
"which core am I", raising checks, the element offsets of stacked per-layer tensors, and identities a kernel may
address by raw access patterns (:func:`own_identity`).

Tile sizes. They are the values of ``nl.tile_size`` on trn2 (SDK ``nki.language.tile_size``; nkisim.hw), written
as plain ints because the real front end does not always give a Python int for ``nl.tile_size.pmax`` where one is
required (nki-library ``cumsum.py``: "nl.tile_size.pmax returns non-int, compiler requires Python int for shapes";
shared/docs/nki-reference.md §2.1). tests/nki_kernels/test_common.py checks them against ``nl.tile_size``.

Stacked tensors. Per-layer weights and state are stacked by layer kind into one HBM tensor ``[L, ...]``
(``megakernel.plan``); a body reads layer ``i`` through the view ``t[i]`` (slices compose with it) and through
``.ap()`` patterns, which address the UNDERLYING storage (SDK "Access patterns", composition: ``t[i].ap(p)`` is
``t.ap(p)``), so every ``.ap()`` offset adds :func:`layer_offset` and a run-time ``scalar_offset`` names the
dimension after the layer one (its stride comes from the base tensor's shape).
"""

from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

P = 128                 # partitions of SBUF / PSUM: nl.tile_size.pmax
PSUM_BANK = 512         # fp32 elements per partition of one PSUM bank (2 KiB): nl.tile_size.psum_bank_fmax
MOVING_MAX = 512        # free size of a matmul's moving operand: nl.tile_size.gemm_moving_fmax
STATIONARY_MAX = 128    # free size of a matmul's stationary operand: nl.tile_size.gemm_stationary_fmax
INT32_MAX = 2 ** 31 - 1  # every integer reaching a kernel fits int32 (SDK language guide "NKI Values")


def kernel_assert(condition, message):
    """Raise ValueError(message) unless ``condition`` holds: a check that guards correctness and, unlike a bare
    ``assert``, survives ``python -O`` (nki-library ``kernel_assert``). The message names the kernel, what was
    expected and what arrived."""
    if not condition:
        raise ValueError(message)


def program_sharding():
    """(number of program instances, this instance's id) of the launch: (2, 0 or 1) under ``kernel[2]``,
    (1, 0) under ``kernel[1]`` or without a grid (nki-library ``kernel_helpers.get_program_sharding_info``)."""
    if nl.program_ndim() == 0:
        return 1, 0
    return nl.num_programs(0), nl.program_id(0)


def layer_offset(t, layer):
    """Element offset of layer ``layer`` of the stacked HBM tensor ``t [L, ...]`` (0 when ``layer`` is None:
    an unstacked tensor). Checked to fit int32, as every element offset into an HBM tensor must."""
    if layer == None:
        return 0
    _check_layer(t, layer)
    n = 1
    for d in t.shape:
        n = n * d
    kernel_assert(n <= INT32_MAX + 1, f"stacked tensor {list(t.shape)} holds {n} elements: its element offsets "
                                      f"exceed int32; stack fewer layers per tensor")
    return layer * (n // t.shape[0])


def layer_of(t, layer):
    """The view of layer ``layer`` of a stacked tensor ``t [L, ...]`` (``t`` itself when ``layer`` is None)."""
    if layer == None:
        return t
    _check_layer(t, layer)
    return t[layer]


def _check_layer(t, layer):
    kernel_assert(0 <= layer and layer < t.shape[0], f"stacked tensor {list(t.shape)}: layer {layer} is outside "
                                                     f"0..{t.shape[0] - 1}")


def dma_on(dst, src, engine=None):
    """``dma_copy(dst, src)`` triggered from the hardware-DGE queue of ``engine`` (``nisa.engine.scalar`` /
    ``sync``, SDK nki-dge.rst "hwdge"; the DMAs of one queue move in order, so a caller keeps a DMA out of the
    default queue's line), or from the default queue when ``engine`` is None."""
    if engine == None:
        nisa.dma_copy(dst=dst, src=src)
    else:
        nisa.dma_copy(dst=dst, src=src, dge_mode=nisa.dge_mode.hwdge, engine=engine)


def own_identity(n: int, dtype, name: str):
    """An n x n identity in an SBUF tile of the kernel's own (``nl.shared_identity_matrix(..., dst=)``: one constant
    DMA, like the shared one). Use it where ``.ap()`` addresses the identity: the shared identity's storage may be a
    larger one the compiler shares ("The compiler will reuse all the identity matrices of the same dtype in the
    graph", SDK-NL), so nkisim refuses a raw access pattern on it."""
    t = nl.ndarray((n, n), dtype, buffer=nl.sbuf, name=name)
    nl.shared_identity_matrix(n=n, dtype=dtype, dst=t)
    return t


def carve(tiles, shape, dtype):
    """Views of shape ``[P, *shape]`` cut in order out of ``tiles`` (SBUF tiles of ``P`` partitions and ``dtype``,
    each taken as one run per partition; other tiles are skipped): as many whole pieces as each holds. For a caller
    that lends a launch-wide arena's bytes to other work while the arena is idle (a fixed home: first-fit placement
    cannot put that work where tiles still in use sit)."""
    n = 1
    for d in shape:
        n *= d
    out = []
    for t in tiles:
        if t.shape[0] != P or t.dtype != dtype:
            continue
        m = t.size // P
        flat = t.reshape((P, m))
        for i in range(m // n):
            out.append(flat[:, i * n:(i + 1) * n].reshape((P,) + tuple(shape)))
    return out
