import numpy as np
import pytest

import nkisim

nkisim.install()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _quiet_frontend_lint():
    """The op tests build kernels from lambdas and comprehensions on purpose; the front-end lint warnings are
    tested in test_fidelity.py."""
    import warnings
    from nkisim.frontend import NkiFrontendWarning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NkiFrontendWarning)
        yield
