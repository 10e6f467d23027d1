"""trn2 cost model: predict device time, engine utilisation and HBM bandwidth from nkisim traces.

    import nkisim; from harness import costmodel
    with nkisim.trace.capture() as tr:
        kernel[2](*args)
    p = costmodel.predict(tr, stages="function")
    print(p.table())                      # latency, busy %, HBM bytes / bandwidth, critical path, stages

Modules: ``constants`` (every number, cited), ``costs`` (per-instruction formulas), ``deps``
(RAW/WAR/WAW graph from trace regions), ``timeline`` (event-driven engines / DMA queues / HBM pipe /
rendezvous), ``predict`` (metrics), ``stages`` (stage tags), ``compose`` (per-round estimate from
per-layer kernels), ``plots``, ``calibration`` (model vs published per-op measurements).
"""
from . import constants
from .predict import Prediction, instructions_of, predict
from .stages import StageMarks

__all__ = ["constants", "predict", "Prediction", "instructions_of", "StageMarks"]
