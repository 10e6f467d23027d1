"""The round megakernel and the layerwise variant's stage kernels, composed from nki_kernels' bodies.

Importing nki_kernels first provides the NKI modules (nkisim's where the Neuron SDK is absent).
``demo_args`` and ``STAGES`` are the cost model's hooks (``python -m harness.bench predict``).
"""

import nki_kernels  # noqa: F401
from megakernel.round import demo_args, stage_of as STAGES  # noqa: E402,F401
