"""CPU executors of exactly the per-rank work the NxDI application launches on trn2.

``CpuEngine(backend="xla")`` runs ``harness.nxdi.xla_math.forward`` -- the function the trn2 module traces
-- once per rank, each rank in its own thread, with real collectives between the threads
(:class:`ThreadWorld`). ``CpuEngine(backend="megakernel")`` launches ``megakernel.round`` under nkisim with
the per-rank keyword arguments ``harness.nxdi.assembly.kernel_kwargs`` builds, as the trn2 module does.
Both hold weights and state as the NxDI parameters would: per rank, converted once at construction.

What these do NOT exercise: NxDI/NxD themselves (tracing, compilation, checkpoint sharding, aliasing on
the device, the real NKI compiler). See harness/nxdi/README.md.
"""

from __future__ import annotations

import threading

import torch

from harness.nxdi import assembly as asm
from harness.nxdi.xla_math import Collectives
from megakernel.round import mutated_names
from megakernel.sharded import gather_state
from model.config import ModelConfig
from model.state import DecodeState
from nki_kernels.host import as_torch


class ThreadWorld:
    """tp ranks, one thread each, with an all-reduce and an all-gather between them.

    Reductions add the ranks' tensors in rank order (identical on every rank, deterministic). A rank that
    raises aborts the barrier so the others fail instead of waiting forever."""

    def __init__(self, tp: int, timeout: float = 600.0):
        self.tp = tp
        self.timeout = timeout
        self._slots: list = [None] * tp
        self._barrier = threading.Barrier(tp, timeout=timeout)

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = t
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()
        return got

    def collectives(self, rank: int) -> Collectives:
        if self.tp == 1:
            return Collectives(all_reduce=lambda t: t, gather_last=lambda t: t)

        def all_reduce(t):
            parts = self._exchange(rank, t)
            acc = parts[0]
            for p in parts[1:]:
                acc = acc + p
            return acc

        def gather_last(t):
            return torch.cat(self._exchange(rank, t), dim=-1)

        return Collectives(all_reduce=all_reduce, gather_last=gather_last)

    def run(self, fn, per_rank_args: list) -> list:
        """fn(rank, collectives, *args) on every rank; returns the results in rank order."""
        results: list = [None] * self.tp
        errors: list = [None] * self.tp

        def body(r):
            try:
                results[r] = fn(r, self.collectives(r), *per_rank_args[r])
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._barrier.reset()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


class CpuEngine:
    """An engine (``harness.nxdi.host.Engine``) on CPU for either backend, tp ranks x lnc cores."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], backend: str, max_len: int, tp: int = 4,
                 lnc: int = 2):
        if backend not in asm.BACKENDS:
            raise asm.AssemblyError(f"backend must be one of {asm.BACKENDS}, found {backend!r}")
        asm.check_sharding(cfg, tp, lnc)
        self.cfg, self.backend, self.tp, self.lnc, self.max_len = cfg, backend, tp, lnc, max_len
        self.dtype = params["model.embed_tokens.weight"].dtype
        self.weights = [asm.rank_weights(cfg, params, backend, r, tp, lnc) for r in range(tp)]
        self.specs = asm.state_specs(cfg, tp, max_len, self.dtype)
        self.states = [asm.zero_states(self.specs) for _ in range(tp)]
        self.launches = 0
        self._world = ThreadWorld(tp)

    def reset(self) -> None:
        """The reset graph's math (``assembly.reset_outputs`` with keep = 0) on every rank."""
        keep = torch.as_tensor(asm.reset_inputs()["keep"])
        for st in self.states:
            new = asm.reset_outputs(keep, st, self.cfg.hidden_size, self.dtype)[len(asm.LEADING_OUTPUTS):]
            st.update(zip(list(st), new))

    def run(self, mode: str, runtime: dict) -> asm.LaunchResult:
        spec = asm.round_spec(self.cfg, self.tp, self.lnc, mode)
        self.launches += 1
        if self.backend == "megakernel":
            outs = self._run_kernel(spec, runtime)
        else:
            outs = self._run_xla(spec, runtime)
        for st, out in zip(self.states, outs):
            st.update(zip(mutated_names(spec), (as_torch(t) for t in out[3:])))
        return asm.read_outputs(*outs[0][:3])

    def _run_kernel(self, spec, runtime):
        import nkisim
        from megakernel.round import build_kernel
        taken = asm.graph_states(spec.mode, spec, self.specs)
        names = asm.kernel_arg_names(self.weights[0], taken, spec.mode)
        kernel = build_kernel(spec, names)
        per_rank = [asm.kernel_kwargs(names, w, {n: st[n] for n in taken}, runtime)
                    for w, st in zip(self.weights, self.states)]
        return nkisim.launch(kernel, per_rank, tp=self.tp, lnc=self.lnc)

    def _run_xla(self, spec, runtime):
        from harness.nxdi.xla_math import forward
        rt = asm.named_inputs(spec.mode, asm.ordered_inputs(spec.mode, runtime))
        taken = asm.graph_states(spec.mode, spec, self.specs)

        def rank(r, coll, w, st):
            draft, targets, hidden, new = forward(self.cfg, spec, w, {n: st[n] for n in taken}, rt, coll)
            return (draft, targets, hidden, *(new[n] for n in mutated_names(spec)))

        return self._world.run(rank, [(w, st) for w, st in zip(self.weights, self.states)])

    def reference_state(self, read_slot: int) -> DecodeState:
        """The decode state gathered over the ranks, in the reference layout (for invariant tests)."""
        like = DecodeState.empty(self.cfg, self.max_len, asm.SLOTS, self.dtype)
        return gather_state(self.cfg, self.states, like, read_slot)
