"""nki.typing (0.3.0+): annotations only."""
import sys as _sys

from . import frontend as _frontend
from .tensor import NkiTensor as tensor  # noqa: F401
from .tensor import NkiTensor  # noqa: F401

_frontend.register_api_module(_sys.modules[__name__], "nki.typing")
