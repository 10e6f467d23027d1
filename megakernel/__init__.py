"""The round megakernel and the layerwise variant's stage kernels, composed from nki_kernels' bodies.

Importing nki_kernels first provides the NKI modules (nkisim's where the Neuron SDK is absent).
"""

import nki_kernels  # noqa: F401
