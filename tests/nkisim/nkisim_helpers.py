"""Tiny kernel builders for op tests: load inputs to SBUF, run one op, store the result."""
import nki
import nki.isa as nisa
import nki.language as nl


def run_op(body, inputs, out_shape, out_dtype, lnc=1):
    """body(sbuf_inputs..., out_sbuf) issues ISA ops; inputs are numpy arrays (2-D, rows on partitions)."""
    def kern(hbm):
        tiles = []
        for h in hbm:
            t = nl.ndarray(h.shape, h.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=h)
            tiles.append(t)
        o = nl.ndarray(out_shape, out_dtype, buffer=nl.sbuf)
        body(*tiles, o)
        out = nl.ndarray(out_shape, out_dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out
    k = nki.jit(kern)
    return (k if lnc == 1 else k[lnc])(tuple(inputs))


def run_body(body, x=None):
    """Run body(x) inside a kernel that otherwise only returns a (1, 1) zero; for checks of what body refuses."""
    import numpy as np

    @nki.jit
    def k(x):
        body(x)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k(np.zeros((4, 4), np.float32) if x is None else x)
