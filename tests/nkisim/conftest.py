import numpy as np
import pytest

import nkisim

nkisim.install()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
