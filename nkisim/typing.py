"""nki.typing (0.3.0+): annotations only."""
from .tensor import NkiTensor as tensor  # noqa: F401
from .tensor import NkiTensor  # noqa: F401
