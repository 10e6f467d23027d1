"""nkisim: CPU interpreter of the NKI 0.6 API for Trainium2 (see nkisim/README.md).

    import nkisim; nkisim.install()          # `import nki` now resolves to nkisim (unless the real SDK exists)
    out = my_kernel[2](x_np, w_np)           # LNC=2 launch, numpy in / numpy out
    outs = nkisim.launch(my_kernel, [(x0,), (x1,), (x2,), (x3,)], tp=4, lnc=2)   # 4 ranks x 2 cores
    with nkisim.trace.capture() as tr: ...   # instruction trace
    my_kernel(nkisim.ShapeDtype((4096, 2048), "bfloat16"))   # shape-only run (trace without data)
    with nkisim.numerics("hardware-like", seed=0): ...   # inexact ACT functions and fp32 matmuls, like trn2
"""
from . import hw, trace
from .errors import (AllocationError, NkiFidelityWarning, NkiValidationError, OutOfBoundsError,
                     UninitializedReadError)
from .frontend import NkiFrontendWarning
from .jit import Kernel, ShapeDtype, jit, register_values, shape_only, simulate
from .jit import launch_ranks as launch
from .numerics import Numerics, numerics
from .registers import RegisterLoad
from .shim import install, real_nki_available

__all__ = ["install", "launch", "real_nki_available", "jit", "simulate", "Kernel", "ShapeDtype", "shape_only", "register_values",
           "RegisterLoad", "trace", "hw", "numerics", "Numerics",
           "NkiValidationError", "UninitializedReadError", "AllocationError", "OutOfBoundsError", "NkiFidelityWarning",
           "NkiFrontendWarning"]
