"""``nki.isa.constants``: the instruction enums under the module name the real package also has.

Not in the API stubs (../shared/docs/nki-api-0.6.json lists the enums under ``nki.isa``), but AWS's nki-library imports
``from nki.isa.constants import oob_mode`` / ``dge_mode`` and ``from nki.isa import constants`` (e.g.
core/subkernels/find_nonzero_indices.py), so the real ``nki`` package provides it."""
from .enums import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd  # noqa: F401
