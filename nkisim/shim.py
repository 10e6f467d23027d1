"""Register nkisim as the ``nki`` package when the real Neuron SDK is absent."""
import importlib
import sys
import types

_installed = False


def real_nki_available():
    """True when a working real ``nki.isa`` is importable (PyPI's placeholder ``nki`` has none)."""
    mod = sys.modules.get("nki")
    if mod is not None and getattr(mod, "__nkisim__", False):
        return False
    try:
        isa = importlib.import_module("nki.isa")
        return hasattr(isa, "nc_matmul") and not getattr(isa, "__nkisim__", False)
    except Exception:            # noqa: BLE001 -- any failure means "no real SDK"
        for k in [k for k in sys.modules if k == "nki" or k.startswith("nki.")]:
            if not getattr(sys.modules[k], "__nkisim__", False):
                del sys.modules[k]
        return False


def install(force=False):
    """Make ``import nki`` / ``nki.language`` / ``nki.isa`` / ``nki.collectives`` / ``nki.typing`` resolve to
    nkisim. Idempotent. Does nothing (returns False) when the real SDK is importable, unless force=True."""
    global _installed
    if _installed and getattr(sys.modules.get("nki"), "__nkisim__", False):
        return True
    if not force and real_nki_available():
        return False
    from . import collectives, frontend, isa, language, public_api
    from .jit import jit as _jit, simulate as _simulate
    from . import typing as nki_typing
    pkg = types.ModuleType("nki")
    pkg.__nkisim__ = True
    pkg.__path__ = []
    pkg.__doc__ = "nkisim: CPU interpreter of the NKI API (see nkisim/README.md)"
    pkg.jit, pkg.simulate = _jit, _simulate
    pkg.__getattr__ = public_api.nki_package_getattr      # nki.dtype (nkisim/public_api.py UNDOCUMENTED)
    frontend.register_api_module(pkg, "nki")
    pkg.language, pkg.isa, pkg.collectives, pkg.typing = language, isa, collectives, nki_typing
    for m in (language, isa, collectives, nki_typing, isa.constants):
        m.__nkisim__ = True
    sys.modules.update({"nki": pkg, "nki.language": language, "nki.isa": isa, "nki.collectives": collectives,
                        "nki.typing": nki_typing, "nki.isa.constants": isa.constants})
    _installed = True
    return True
