"""trn2 cost model: predict device time, engine utilisation and HBM bandwidth from nkisim traces.

    import nkisim; from harness import costmodel
    with nkisim.trace.capture() as tr:
        kernel[2](*args)
    b = costmodel.predict_band(tr, stages="function")   # low / central / high
    print(b.time_us(), b.central.table())

Modules: ``constants`` (every number, cited; uncertain ones as bands), ``costs`` (per-instruction formulas at one
end of the bands), ``deps`` (RAW/WAR/WAW graph from trace regions), ``timeline`` (event-driven engines, DMA
trigger queues, DGEs, bandwidth sharing, loop fences, rendezvous), ``predict`` (metrics, critical path),
``stages`` (stage tags), ``layers`` (per-layer critical-path breakdown), ``compose`` (round estimates: the
megakernel, the layerwise graph, rooflines), ``plots``, ``calibration`` (model vs published measurements).
"""
from . import constants
from .costs import Params
from .predict import BandPrediction, Prediction, instructions_of, predict, predict_band
from .stages import StageMarks

__all__ = ["constants", "predict", "predict_band", "Prediction", "BandPrediction", "Params", "instructions_of",
           "StageMarks"]
