"""Exceptions. Messages say what was expected, what arrived, and where (DESIGN §5)."""


class NkiValidationError(Exception):
    """A documented hardware/compiler rule was violated (exported as nki.isa.NkiValidationError)."""


class UninitializedReadError(NkiValidationError):
    """An instruction read memory that no instruction (and no kernel argument) ever wrote."""


class AllocationError(NkiValidationError):
    """SBUF / PSUM / HBM capacity exceeded or an invalid manual placement."""


class OutOfBoundsError(NkiValidationError):
    """Index or dynamic offset outside the tensor."""


class LaunchAborted(Exception):
    """Raised inside an LNC instance when its sibling instance failed."""


def fail(op, msg, exc=NkiValidationError):
    raise exc(f"{op}: {msg}")
