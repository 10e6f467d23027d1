"""Hand-written NKI decode subkernels (see nki_kernels/README.md).

The kernels import the real NKI modules (``import nki``). Where the Neuron SDK is absent, nkisim's CPU
interpreter provides them; on a trn2 host with the SDK, ``nkisim.install()`` does nothing.
"""

import nkisim

nkisim.install()
