"""The decode launch as data (``plan``), the round and step megakernels that run it in one launch per rank
(``round``), the layerwise variant's stage kernels (``layerwise``) and the stacked per-rank layouts they read
(``sharded``), composed from nki_kernels' bodies.

Importing nki_kernels first provides the NKI modules (nkisim's where the Neuron SDK is absent).
"""

import nki_kernels  # noqa: F401
