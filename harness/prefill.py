"""Time to first token on trn2: the NKI prefill pass (``megakernel.prefill``) predicted from shape-only traces.

``python -m harness.bench prefill --context 1024 4096 32768 131072 [--chunk 4096] [--json]``

For each prompt length n the pass is the plan of ``megakernel.prefill.prefill_plan`` (chunks of ``--chunk``
tokens); every kernel it launches is traced shape-only under nkisim at the real per-rank shapes (TP=4 x LNC=2)
and predicted with the trn2 cost model (``harness.costmodel.predict_band``), and the time to first token is the
sum, per chunk, of

* the embedding (``embedding_prefill``: one launch, a gather per 128 tokens) and the first layer's input
  RMSNorm (``rmsnorm_prefill``),
* per layer the mixer kernel: ``gdn_prefill``, then the residual all-reduce fused with the post-attention
  RMSNorm's rows (``megakernel.prefill.residual_allreduce_stage``, traced on 4 ranks with its collectives); or
  ``attention_prefill`` at the chunk's start with that all-reduce, the residual add and the norm's rows fused
  into its o_proj (``attention_prefill_kernel(residual=...)``, traced on 4 ranks: the ``attention_prefill`` part
  includes that all-reduce),
* per layer ``moe_prefill`` with the residual all-reduce and the next RMSNorm fused into its combine (the next
  layer's input norm's xT, after the last layer the final norm's rows; ``moe_prefill(residual=...)``, traced on
  4 ranks: the ``moe_prefill`` part includes that all-reduce),
* the MTP fc and the MTP layer's K/V rows over the chunk's rows (``attention_prefill_kv_kernel``: its attention
  output is not needed),
* on the last chunk the decode head stage on the last position (final norm + LM head + argmax),
* one launch overhead per kernel launch (``costmodel.constants.LAUNCH_OVERHEAD_NS``: the kernels run one after
  the other, the composition does not overlap them).

Band ends are summed end by end (low with low, ...): the ends are correlated (the same constants), so the sum of
the high ends is what one set of pessimistic constants gives. Attention depends on the chunk's start (rows of the
earlier chunks it reads); chunks at starts above ``MAX_TRACED_START`` are EXTRAPOLATED linearly from the traced
chunks (its context loop costs the same per key block) and the output says so. Routing: the MoE prefill's
shape-only registers read 0, which is its realistic case (every expert slot used, no heavy expert, kernel
docstring).

Beside it: the teacher-forced baseline -- the prompt fed through the decode launches, 1 + ceil((n-1)/2) launches
at the round time of the last ``harness.bench predict`` (bench/costmodel_predict.json; a lower bound, rounds at
longer contexts cost more) -- and the floor: per chunk the larger of every per-rank weight byte read once (at
the fast end of the HBM band) and the chunk's FLOPs at the PE's measured peak (132 TFLOP/s per rank).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

ENDS = ("low", "central", "high")
MAX_TRACED_START = 28 * 1024      # attention chunks beyond this start are extrapolated (trace size and time)
BENCH = Path(__file__).resolve().parent.parent / "bench"


def _band_sum(parts):
    return {e: sum(p[e] for p in parts) for e in ENDS}


def _scale(b, k):
    return {e: b[e] * k for e in ENDS}


_PREDICTED = {}


def _traced(name, builder):
    """{low, central, high} us of one traced launch, memoised per process by ``name`` (the same kernel at the
    same shapes is traced once)."""
    from harness.costmodel import predict_band
    if name not in _PREDICTED:
        _PREDICTED[name] = predict_band(builder().trace(), stages="function", name=str(name[0])).time_us()
    return _PREDICTED[name]


def _case(kernel, per_rank, tp=1, lnc=2, name="kernel"):
    from harness.kernel_cases import KernelCase
    return KernelCase(name, kernel, per_rank, tp, lnc)


class Costs:
    """Per-launch predictions of the prefill kernels for one config at the real per-rank shapes (memoised)."""

    def __init__(self, cfg, tp=4, lnc=2, dtype="bfloat16"):
        self.cfg, self.tp, self.lnc, self.dtype = cfg, tp, lnc, dtype
        self.key = (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.num_experts, tp, lnc, dtype)

    def _sd(self, shape, dtype=None):
        import nkisim
        return nkisim.ShapeDtype(tuple(shape), dtype or self.dtype)

    def gdn(self, N):
        from harness.kernel_cases import gdn_prefill_launch

        def build():
            kern, args = gdn_prefill_launch(self.cfg, tp=self.tp, L=N, dtype=self.dtype)
            return _case(kern, [args], lnc=1)
        return _traced(("gdn", self.key, N), build)

    def attention_fused(self, N, start, norm):
        """``attention_prefill`` at ``start`` with the next step fused (residual + all-reduce over the cores and TP
        ranks + the next RMSNorm's ``norm`` output: rows | xT | none; ``attention_prefill_kernel(residual=...)``),
        traced on every rank (its collectives)."""
        from harness.kernel_cases import attention_prefill_launch
        from nki_kernels import attention_prefill as ap
        from nki_kernels.common import P
        H = self.cfg.hidden_size

        def build():
            _, args = attention_prefill_launch(self.cfg, tp=self.tp, N=N, start=start, dtype=self.dtype)
            w = self._sd((P, H // P), "float32") if norm != "none" else None
            full = tuple(args) + (self._sd((N, H)), self.tp, w, norm)
            return _case(ap.attention_prefill_kernel, [full] * self.tp, tp=self.tp, lnc=self.lnc)
        return _traced(("attention_fused", self.key, N, start, norm), build)

    def mtp_kv(self, N):
        """The MTP layer's K/V rows of N prompt rows (``attention_prefill_kv_kernel``; no start dependence: the
        start only offsets the cache-row DMAs)."""
        from nki_kernels import attention_prefill as ap
        H, D, R = self.cfg.hidden_size, self.cfg.head_dim, self.cfg.rotary_dim
        L = max(ap.KEY_BLOCK, -(-N // ap.KEY_BLOCK) * ap.KEY_BLOCK)

        def build():
            args = (self._sd((ap.P, H // ap.P, N)), self._sd((H, D)), self._sd((H, D)), self._sd((2, D), "float32"),
                    self._sd((N, R), "float32"), self._sd((N, R), "float32"), self._sd((1, L, D)),
                    self._sd((1, L, D)), self._sd((1, 1), "int32"), float(self.cfg.rms_norm_eps))
            return _case(ap.attention_prefill_kv_kernel[self.lnc] if self.lnc > 1 else ap.attention_prefill_kv_kernel,
                         [args], lnc=1)
        return _traced(("mtp_kv", self.key, N), build)

    def moe_fused(self, N, norm):
        """``moe_prefill`` with the next step fused (residual + all-reduce over the TP ranks + the next RMSNorm's
        ``norm`` output: rows | xT | none), traced on every rank (its collectives)."""
        from harness.kernel_cases import moe_prefill_launch
        from nki_kernels.common import P
        H = self.cfg.hidden_size

        def build():
            from nki_kernels.moe_prefill import moe_prefill
            _, args = moe_prefill_launch(self.cfg, tp=self.tp, N=N, dtype=self.dtype, lnc=self.lnc)
            w = self._sd((P, H // P), "float32") if norm != "none" else None
            full = tuple(args) + (None, self._sd((N, H)), self.tp, w, float(self.cfg.rms_norm_eps), norm)
            return _case(moe_prefill, [full] * self.tp, tp=self.tp, lnc=self.lnc)
        return _traced(("moe_fused", self.key, N, norm), build)

    def norm(self, N, layout):
        """The chunk's RMSNorm with one output: "rows" (token-major) or "xT" (feature-major)."""
        from nki_kernels.common import P
        from nki_kernels.rmsnorm_prefill import rmsnorm_prefill_kernel
        H = self.cfg.hidden_size

        def build():
            args = (self._sd((N, H)), self._sd((P, H // P), "float32"), float(self.cfg.rms_norm_eps),
                    layout == "rows", layout == "xT")
            return _case(rmsnorm_prefill_kernel, [args], lnc=self.lnc)
        return _traced(("norm", self.key, N, layout), build)

    def allreduce(self, N, per_core, norm="none"):
        """x + all-reduce of the chunk's partials, fused with the next RMSNorm's output ``norm`` (rows | xT | none)."""
        from megakernel.prefill import residual_allreduce_stage
        from nki_kernels.common import P
        H = self.cfg.hidden_size

        def build():
            part = self._sd((self.lnc, N, H) if per_core else (N, H), "float32")
            w = self._sd((P, H // P), "float32") if norm != "none" else None
            args = (self._sd((N, H)), part, self.tp, per_core, w, float(self.cfg.rms_norm_eps), norm)
            return _case(residual_allreduce_stage, [args] * self.tp, tp=self.tp, lnc=self.lnc)
        return _traced(("allreduce", self.key, N, per_core, norm), build)

    def mtp_fc(self, N):
        from harness.kernel_cases import rank_tensors
        from megakernel.plan import NormRows
        from megakernel.prefill import mtp_fc_prefill_stage
        H = self.cfg.hidden_size

        def build():
            w = rank_tensors(self.cfg, self.tp, self.lnc, 2048, self.dtype)[0]
            rows = NormRows(self.cfg.num_hidden_layers, True)
            args = (self._sd((N, H)), self._sd((N, H)), w["norms"], rows.mtp_emb, rows.mtp_hidden, w["mtp_fc"],
                    float(self.cfg.rms_norm_eps))
            return _case(mtp_fc_prefill_stage, [args], lnc=self.lnc)
        return _traced(("mtp_fc", self.key, N), build)

    def embed(self, N):
        """The embedding of N tokens: one ``embedding_prefill_kernel`` launch."""
        from nki_kernels.embedding_prefill import embedding_prefill_kernel
        H, V = self.cfg.hidden_size, self.cfg.vocab_size

        def build():
            kern = embedding_prefill_kernel[self.lnc] if self.lnc > 1 else embedding_prefill_kernel
            return _case(kern, [(self._sd((V, H)), np.zeros((N, 1), np.int32))], lnc=1)
        return _traced(("embed", self.key, N), build)

    def head(self):
        from harness.kernel_cases import stage_case
        return _traced(("head", self.key), lambda: stage_case(self.cfg, "head", 1, tp=self.tp, lnc=self.lnc,
                                                                dtype=self.dtype))


def _attention_chunk(costs, N, start, measured):
    """Attention at ``start`` with its all-reduce and the post-attention norm's rows fused
    (:meth:`Costs.attention_fused`): traced up to MAX_TRACED_START, else a straight line through the two traced
    chunks of length N with the largest starts (``measured``: start -> band); returns (band, extrapolated)."""
    if start <= MAX_TRACED_START:
        b = costs.attention_fused(N, start, "rows")
        measured[start] = b
        return b, False
    pts = sorted(measured)[-2:]
    if len(pts) < 2:
        for s in (MAX_TRACED_START - N, MAX_TRACED_START):
            measured[s] = costs.attention_fused(N, s, "rows")
        pts = sorted(measured)[-2:]
    s0, s1 = pts
    return {e: measured[s0][e] + (measured[s1][e] - measured[s0][e]) * (start - s0) / (s1 - s0) for e in ENDS}, True


def floor_us(cfg, plan, tp=4, lnc=2, dtype="bfloat16"):
    """The byte / FLOP floor of the pass (module docstring), us."""
    from harness.costmodel import constants as C
    from harness.kernel_cases import rank_tensors
    w = rank_tensors(cfg, tp, lnc, 2048, dtype)[0]
    size = {k: int(np.prod(v.shape)) * (4 if v.dtype == "float32" else 2) for k, v in w.items()
            if not k.startswith(("gdn_window", "gdn_state", "attn_k", "attn_v"))}
    experts = sum(v for k, v in size.items() if k.startswith("moe_experts_"))
    dense = sum(v for k, v in size.items() if k not in ("embed", "lm_head") and not k.startswith("moe_experts_"))
    bw = C.HBM_BW_PER_RANK.low                                     # the fast end, bytes/ns
    peak = 2 * 128 * 128 * C.PE_COLUMNS_PER_CYCLE * C.PE_CLOCK_HZ * lnc / 1e9   # FLOP/ns per rank
    active = dense / 2 + experts / 2 * cfg.num_experts_per_tok / cfg.num_experts  # weight elements per token
    hq = cfg.num_attention_heads // tp
    attn_layers = len(cfg.full_layers) + (1 if cfg.mtp_num_hidden_layers else 0)
    total = 0.0
    for ch in plan.chunks:
        N = ch.tokens
        flops = 2 * N * active + attn_layers * 4 * hq * cfg.head_dim * N * (ch.start + N / 2)
        nbytes = dense + experts + (size["lm_head"] if ch is plan.last else 0)
        total += max(nbytes / bw, flops / peak)
    return total / 1e3


def baseline_us(n, model):
    """Teacher-forced prefill through the decode launches: (band us, launches, source); band and source None
    without a stored round prediction of ``model``."""
    path = BENCH / "costmodel_predict.json"
    launches = 1 + math.ceil((n - 1) / 2)
    d = json.loads(path.read_text()) if path.exists() else {}
    if d.get("model") != model:
        return None, launches, None
    return (_scale(d["round_us"], launches), launches,
            f"{launches} launches x the round at context {d['context']} (bench/costmodel_predict.json, "
            f"{d.get('measured_commit')}); a lower bound: rounds at longer contexts cost more")


def predict(cfg, n, chunk=None, tp=4, lnc=2, dtype="bfloat16", progress=None, model=None):
    """The time-to-first-token prediction of an n-token prompt (module docstring) as a dict."""
    from harness.costmodel import constants as C
    from megakernel.prefill import CHUNK, prefill_plan
    chunk = chunk or CHUNK
    plan = prefill_plan(cfg, n, tp, lnc, chunk)
    costs = Costs(cfg, tp, lnc, dtype)
    n_gdn = sum(1 for layer in plan.layers if layer.kind == "gdn")
    n_attn = len(plan.layers) - n_gdn
    measured, parts, chunks, extrapolated = {}, {}, [], []
    launches = 0

    def add(key, band, count=1):
        parts.setdefault(key, []).append(_scale(band, count))

    for i, ch in enumerate(plan.chunks):
        if progress:
            progress(f"chunk {i + 1}/{len(plan.chunks)} (start {ch.start}, {ch.tokens} tokens)")
        N = ch.tokens
        before = {k: len(v) for k, v in parts.items()}
        add("embedding", costs.embed(N))
        L = len(plan.layers)
        add("rmsnorm", costs.norm(N, "xT"))                     # the first layer's input norm
        add("gdn_prefill", costs.gdn(N), n_gdn)
        att, ext = _attention_chunk(costs, N, ch.start, measured)
        if ext:
            extrapolated.append(ch.start)
        add("attention_prefill", att, n_attn)
        # after each GDN mixer: all-reduce + the post-attention norm's rows (a launch of its own; the attention
        # kernel has them fused); each MoE with its all-reduce fused, + the next layer's input norm (xT), after the
        # last one the final norm's rows (the MTP head's hidden) or nothing
        add("all_reduce", costs.allreduce(N, True, "rows"), n_gdn)
        add("moe_prefill", costs.moe_fused(N, "xT"), L - 1)
        add("moe_prefill", costs.moe_fused(N, "rows" if ch.mtp_rows else "none"))
        k = 2 + 2 * L + n_gdn
        if ch.mtp_rows:
            m = ch.mtp_rows
            add("embedding", costs.embed(m))
            add("rmsnorm", costs.norm(m, "xT"))
            add("mtp", costs.mtp_fc(m))
            add("mtp", costs.mtp_kv(m))                          # its K/V rows only: the output is not needed
            k += 4
        if ch is plan.last:
            add("lm_head", costs.head())
            k += 1
        add("launch_overhead", {e: k * C.LAUNCH_OVERHEAD_NS / 1e3 for e in ENDS})
        launches += k
        chunk_band = _band_sum([b for key, v in parts.items() for b in v[before.get(key, 0):]])
        chunks.append({"start": ch.start, "tokens": N, "us": chunk_band})
    ttft = _band_sum([c["us"] for c in chunks])
    base, base_launches, base_src = baseline_us(n, model)
    return {"context": n, "chunk": chunk, "chunks": len(plan.chunks), "ttft_us": ttft,
            "parts_us": {k: _band_sum(v) for k, v in parts.items()}, "per_chunk_us": chunks,
            "launches": launches, "extrapolated_starts": extrapolated,
            "baseline_us": base, "baseline_launches": base_launches, "baseline_source": base_src,
            "floor_us": floor_us(cfg, plan, tp, lnc, dtype), "tp": tp, "lnc": lnc, "dtype": dtype,
            "model": model}


# ---- the bench subcommand ---------------------------------------------------------------------------------------
def add_arguments(p):
    p.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 32768, 131072],
                   help="prompt lengths to predict (default 1024 4096 32768 131072)")
    p.add_argument("--chunk", type=int, default=None, help="prompt tokens per prefill chunk (default 4096; a "
                                                            "multiple of 64); a shorter prompt is one chunk")
    p.add_argument("--model", default="qwen3.6-35b-a3b", help="model.config preset (default qwen3.6-35b-a3b)")
    p.add_argument("--json", action="store_true", help="print the JSON (also written to --output)")
    p.add_argument("--output", type=Path, default=BENCH / "prefill.json", help="JSON file (default bench/prefill.json)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _fmt(b):
    return f"{b['central'] / 1e3:,.1f} ({b['low'] / 1e3:,.1f}-{b['high'] / 1e3:,.1f})"


def markdown(rows):
    out = ["| prompt | chunks | TTFT ms, NKI prefill (band) | teacher-forced baseline ms | floor ms | extrapolated |",
           "|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        base = _fmt(r["baseline_us"]) if r["baseline_us"] else "-"
        ext = f"attention at starts {r['extrapolated_starts'][0]}..{r['extrapolated_starts'][-1]}" \
            if r["extrapolated_starts"] else "no"
        out.append(f"| {r['context']:,} | {r['chunks']} | {_fmt(r['ttft_us'])} | {base} | "
                   f"{r['floor_us'] / 1e3:,.1f} | {ext} |")
    return "\n".join(out)


def cmd(a):
    import sys

    import nkisim
    from model.config import preset
    nkisim.install()
    try:
        cfg = preset(a.model)
    except Exception as e:
        print(f"error: prefill: unknown --model {a.model!r} ({e})", file=sys.stderr)
        return 2
    for n in a.context:
        if n < 1:
            print(f"error: prefill: --context must be >= 1, got {n}", file=sys.stderr)
            return 2
    if a.chunk is not None and (a.chunk < 64 or a.chunk % 64):
        print(f"error: prefill: --chunk must be a positive multiple of 64, got {a.chunk}", file=sys.stderr)
        return 2
    progress = None if a.quiet else (lambda s: print(f"  {s}", file=sys.stderr, flush=True))
    rows = []
    for n in a.context:
        if progress:
            progress(f"context {n:,}")
        rows.append(predict(cfg, n, a.chunk, progress=progress, model=a.model))
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(rows if len(rows) > 1 else rows[0], indent=1))
    if a.json:
        print(json.dumps(rows if len(rows) > 1 else rows[0], indent=1))
        return 0
    print(markdown(rows))
    for r in rows:
        print(f"\ncontext {r['context']:,}: " + ", ".join(f"{k} {v['central'] / 1e3:,.2f} ms"
                                                          for k, v in r["parts_us"].items()))
        if r["extrapolated_starts"]:
            print(f"  EXTRAPOLATED: attention of {len(r['extrapolated_starts'])} chunks (starts > "
                  f"{MAX_TRACED_START:,}) from the traced chunks, linear in the start")
        if r["baseline_source"]:
            print(f"  baseline: {r['baseline_source']}")
    print(f"\nwrote {a.output}")
    return 0


# ---- the NKI prefill in a decoder (harness.speculative.Decoder with prefill through the prefill kernels) --------
PREFILL_MODES = ("nki", "host", "teacher-forced")


def nki_prefill_decoder_class():
    """The ``NkiPrefillDecoder`` class, built on first call (``harness.speculative`` is imported only then)."""
    from harness.speculative import Decoder

    class NkiPrefillDecoder(Decoder):
        """A ``harness.speculative.Decoder`` whose prefill runs the NKI prefill pass (``megakernel.prefill``) on
        its engine's own weights and decode state, chunk by chunk; rounds and steps are the engine's.
        ``prefill_info`` describes the last prefill: backend "nki", launches, chunks."""

        def __init__(self, engine, chunk: int | None = None):
            from megakernel.prefill import CHUNK, prefill_chunks
            if not hasattr(engine, "states") or engine.name == "xla":
                raise ValueError(f"prefill: the NKI prefill runs on the layerwise and megakernel engines, not "
                                 f"{engine.name!r}")
            super().__init__(engine, reference=None)
            self.chunk = chunk or CHUNK
            prefill_chunks(1, self.chunk)                  # refuses a chunk that is not a multiple of 64
            self.prefill_info = None

        def prefill(self, prompt: list[int], max_len: int):
            from megakernel.prefill import LayerwisePrefill
            self.begin_prefill(prompt, max_len)
            res = LayerwisePrefill(self.engine).run(list(prompt), self.chunk)
            self.engine.launches += res.launches
            self.prefill_info = {"backend": "nki", "launches": res.launches, "chunks": res.chunks,
                                 "chunk": self.chunk}
            return res.first, res.hidden

    return NkiPrefillDecoder


def nki_decoder(name: str, cfg, params, tp: int = 4, lnc: int = 2, chunk: int | None = None, **engine_kw):
    """The ``name`` variant (layerwise | megakernel) with its prefill through the NKI prefill kernels
    (``engine_kw``: further ``harness.engines.make_engine`` options, e.g. ``drafts``)."""
    from harness.engines import make_engine
    return nki_prefill_decoder_class()(make_engine(name, cfg, params, tp=tp, lnc=lnc, **engine_kw), chunk)


def backend_of(variant: str, mode: str) -> str:
    """The prefill backend a decode.py variant uses for ``--prefill mode``. auto = host: the host PyTorch model
    ("xla") for every variant, so a comparison of variants starts from one decode state (in bfloat16 the NKI pass
    rounds in another order than the token-by-token host model, and greedy tokens can part after a near tie);
    nki: the NKI prefill kernels for the kernel variants (the xla variant, which has none, keeps the host model)."""
    if mode in ("auto", "host") or (mode == "nki" and variant == "xla"):
        return "xla"
    return mode


def make_variant(variant: str, cfg, params, tp: int, mode: str = "auto", chunk: int | None = None, **engine_kw):
    """A decode.py variant with the prefill of ``--prefill mode`` (:func:`backend_of`); ``engine_kw`` go to the
    engine (e.g. ``drafts``)."""
    from harness.speculative import make_decoder
    backend = backend_of(variant, mode)
    if backend == "nki":
        return nki_decoder(variant, cfg, params, tp=tp, chunk=chunk, **engine_kw)
    v = make_decoder(variant, cfg, params, tp=tp, **engine_kw)
    if backend == "teacher-forced":
        v.reference = None
    return v


def report(decoder, n: int, predicted=None) -> dict:
    """decode.py's ``prefill`` JSON object of a decoder after a run on an n-token prompt: backend, launches (NKI
    kernel launches; teacher-forced: decode launches; host: 0), chunks, predicted_us (trn2 band or None)."""
    from megakernel.plan import teacher_forced_launches
    info = getattr(decoder, "prefill_info", None)
    if info is not None:
        return {**info, "predicted_us": predicted}
    if decoder.reference is None:
        return {"backend": "teacher-forced", "launches": len(teacher_forced_launches(n)), "predicted_us": predicted}
    return {"backend": "xla", "launches": 0, "predicted_us": None}
