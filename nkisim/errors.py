"""Exceptions. Messages say what was expected, what arrived, and where (DESIGN §5)."""


class NkiValidationError(Exception):
    """A documented hardware/compiler rule was violated (exported as nki.isa.NkiValidationError)."""


class UninitializedReadError(NkiValidationError):
    """An instruction read memory that no instruction (and no kernel argument) ever wrote."""


class AllocationError(NkiValidationError):
    """SBUF / PSUM / HBM capacity exceeded or an invalid manual placement."""


class OutOfBoundsError(NkiValidationError):
    """Index or dynamic offset outside the tensor."""


class NkiFidelityWarning(UserWarning):
    """Code the real toolchain probably rejects, on evidence that is not (yet) official documentation: nkisim
    runs it but says so. Turn into errors with ``warnings.simplefilter("error", NkiFidelityWarning)``."""


class LaunchAborted(Exception):
    """Raised inside an LNC instance when its sibling instance failed."""


def fail(op, msg, exc=NkiValidationError):
    raise exc(f"{op}: {msg}")


def by_switch(level, msg, stacklevel=4):
    """Apply a rule whose severity is a ``nkisim.hw`` switch: "error" raises NkiValidationError, "warn" warns
    NkiFidelityWarning, "off" does nothing."""
    if level == "error":
        raise NkiValidationError(msg)
    if level == "warn":
        import warnings
        warnings.warn(msg, NkiFidelityWarning, stacklevel=stacklevel)
    elif level != "off":
        raise ValueError(f"nkisim.hw switch value {level!r}: expected 'error', 'warn' or 'off'")
