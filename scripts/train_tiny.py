"""Train the embedded default model: the ``tiny`` preset with its MTP head, on CPU.

    python scripts/train_tiny.py               # train, save model/embedded/tiny/, measure acceptance
    python scripts/train_tiny.py --eval-only   # re-measure the shipped checkpoint only

Data: the Python standard library's own ``.py`` files (every machine with Python
has them offline), sorted by path; a file is held out for evaluation when
``crc32(path) % 10 == 0``. Tokens are bytes (``model.tokenizer``); each file is
``<|bos|> bytes <|eos|>`` and training windows are random slices of the
concatenation of the training files.

Model: the trunk is transformers' ``Qwen3_5MoeForCausalLM`` built from
``cfg.to_hf_dict()`` (the external reference of the trunk math; torch fallback
paths, sdpa attention, grouped-mm experts). The MTP head is built here from
transformers' pieces exactly as vLLM's ``Qwen3_5MoeMTP`` computes it
(``shared/docs/qwen36.md`` §5): for position t,
``u = fc(concat[rms_norm(embed(x[t+1])), rms_norm(h[t])])``, one full-attention MoE
decoder layer with causal attention over the MTP positions at RoPE position t,
``mtp.norm``, the shared ``lm_head``; trained to predict x[t+2]. ``h[t]`` is the
trunk hidden after ``model.norm``. The GDN mixers run ``gdn_train_forward`` (the
same math on the same parameters, cheaper on CPU), and ``parity_check`` compares
the whole training forward with ``model.reference`` before and after training.

The MTP loss is NOT detached from the trunk hidden (default): its gradient also
trains the trunk to put next-next-token information into h[t], which is the only
view of the context the one-layer MTP head gets besides its own attention over
those hiddens. Loss = trunk CE + mtp_weight * MTP CE + aux_weight * router
load-balancing loss of the trunk.

Everything is seeded, runs on 2 threads with torch's deterministic algorithms, and
the step count (not a wall-clock budget) fixes the schedule, so a rerun on the same
Python, torch and CPU reproduces the checkpoint bit for bit. The acceptance measurement decodes held-out prompts with the
project's speculative loop on the shipped bf16 weights and writes
``bench/tiny_acceptance.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
import types
import zlib
from pathlib import Path

# OpenMP threads that spin while waiting make a 2-thread run crawl when other processes
# share the 2 cores; sleeping waits cost nothing on an idle machine. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from model import tokenizer as byte_tok  # noqa: E402
from model.config import FULL, ModelConfig, preset  # noqa: E402
from model.params import expected_shapes, is_fp32_param  # noqa: E402

EMBEDDED_DIR = ROOT / "model" / "embedded" / "tiny"
BENCH_JSON = ROOT / "bench" / "tiny_acceptance.json"
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


def stdlib_files() -> tuple[Path, list[str]]:
    """(stdlib root, sorted relative paths of its .py files, test suites and site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts))
    if not files:
        raise SystemExit(f"train_tiny: no .py files found under the stdlib at {root}")
    return root, files


def is_held_out(rel_path: str) -> bool:
    """Deterministic ~10% evaluation split, stable under adding or removing other files."""
    return zlib.crc32(rel_path.encode()) % 10 == 0


def token_stream(root: Path, files: list[str], cfg: ModelConfig) -> torch.Tensor:
    """Concatenation of <|bos|> bytes <|eos|> over files, int64 [N]."""
    parts = []
    for rel in files:
        data = (root / rel).read_bytes()
        parts.append(torch.tensor([cfg.bos_token_id], dtype=torch.int16))
        if data:
            parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
        parts.append(torch.tensor([cfg.eos_token_id[0]], dtype=torch.int16))
    return torch.cat(parts).long()


def eval_prompts(root: Path, files: list[str], n: int, length: int) -> list[tuple[str, list[int]]]:
    """n prompts of `length` bytes from held-out files: one per file (cycling if needed),
    starting at the first line start after the file's midpoint. Prompts are plain text
    bytes (no BOS), like ``--prompt`` text through the tokenizer."""
    out, i = [], 0
    candidates = [f for f in files if (root / f).stat().st_size >= 4 * length]
    while len(out) < n:
        rel = candidates[i % len(candidates)]
        data = (root / rel).read_bytes()
        # the k-th pass over the files starts later in each file, so prompts stay distinct
        frac = (0.5 + 0.37 * (i // len(candidates))) % 0.9
        start = data.find(b"\n", int(len(data) * frac)) + 1
        chunk = data[start:start + length]
        if len(chunk) == length:
            out.append((f"{rel}@{start}", list(chunk)))
        i += 1
        if i > 10 * n + len(candidates):
            raise SystemExit("train_tiny: not enough held-out text for the evaluation prompts")
    return out


# ---------------------------------------------------------------------------
# Model (transformers trunk + MTP head built from transformers pieces)
# ---------------------------------------------------------------------------

GDN_CHUNK = 64


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Batched, differentiable chunked gated delta rule from a zero state (training).

    q, k: [B, L, Hk, Dk] raw (l2-normalised here, q scaled by Dk^-0.5); v: [B, L, Hv, Dv];
    g (log-decay), beta: [B, L, Hv]. Value head h uses key head h // (Hv/Hk).
    Same WY/UT-transform math as ``model.functional.gdn_chunked`` (see its docstring),
    with one triangular solve for both right-hand sides. Returns o [B, L, Hv, Dv] fp32.
    """
    B, L, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    r = Hv // Hk
    q = _l2norm(q.float()) * Dk ** -0.5
    k = _l2norm(k.float())
    pad = (-L) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    Lp = L + pad
    N, C = Lp // chunk, chunk
    # [B, H, N, C, D]
    q = q.transpose(1, 2).repeat_interleave(r, 1).reshape(B, Hv, N, C, Dk)
    k = k.transpose(1, 2).repeat_interleave(r, 1).reshape(B, Hv, N, C, Dk)
    v = v.float().transpose(1, 2).reshape(B, Hv, N, C, Dv)
    gam = g.float().transpose(1, 2).reshape(B, Hv, N, C).cumsum(-1)
    beta = beta.float().transpose(1, 2).reshape(B, Hv, N, C, 1)
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta
    a = (kb @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta, kb * gam.exp()[..., None]], -1)
    x = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = x.split([Dv, Dk], -1)
    attn = (q @ k.transpose(-1, -2)) * decay
    qg = q * gam.exp()[..., None]
    last = gam[..., -1:]
    kg = k * (last - gam).exp()[..., None]
    cd = last.exp()[..., None]  # [B,H,N,1,1]
    s = q.new_zeros(B, Hv, Dk, Dv)
    outs = []
    for n in range(N):
        vn = u[:, :, n] - w[:, :, n] @ s
        outs.append(qg[:, :, n] @ s + attn[:, :, n] @ vn)
        s = s * cd[:, :, n] + kg[:, :, n].transpose(-1, -2) @ vn
    o = torch.stack(outs, 2).reshape(B, Hv, Lp, Dv)[:, :, :L]
    return o.transpose(1, 2)


def gdn_train_forward(mod, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Training forward of a transformers ``Qwen3_5MoeGatedDeltaNet`` (no cache, no padding mask).

    The module's own parameters, the same math as its forward (checked by ``parity_check``),
    cheaper on CPU (a training step takes about 30% less CPU time): one fused input
    projection, the depthwise causal conv as K shifted multiply-adds, and
    ``chunk_gated_delta_rule`` above.
    """
    if cache_params is not None or (attention_mask is not None and not bool(attention_mask.all())):
        raise RuntimeError("gdn_train_forward: training only (no cache, no padding mask)")
    x = hidden_states
    B, L, _ = x.shape
    kd, vd, hv = mod.key_dim, mod.value_dim, mod.num_v_heads
    w = torch.cat([mod.in_proj_qkv.weight, mod.in_proj_z.weight, mod.in_proj_b.weight, mod.in_proj_a.weight])
    u, z, b, a = F.linear(x, w).split([mod.conv_dim, vd, hv, hv], -1)
    cw = mod.conv1d.weight[:, 0, :]
    K = cw.shape[1]
    up = F.pad(u, (0, 0, K - 1, 0))
    c = up[:, 0:L] * cw[:, 0]
    for j in range(1, K):
        c = c + up[:, j:j + L] * cw[:, j]
    c = F.silu(c)
    q, kk, v = c.split([kd, kd, vd], -1)
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    o = chunk_gated_delta_rule(q.reshape(B, L, -1, mod.head_k_dim), kk.reshape(B, L, -1, mod.head_k_dim),
                  v.reshape(B, L, hv, mod.head_v_dim), g, b.sigmoid(), GDN_CHUNK)
    o = o.to(x.dtype)
    y = mod.norm(o.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim)).reshape(B, L, vd)
    return mod.out_proj(y)


def hf_text_config(cfg: ModelConfig):
    from transformers import Qwen3_5MoeTextConfig

    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    hc = Qwen3_5MoeTextConfig(**d)
    hc._attn_implementation = "sdpa"
    hc._experts_implementation = "grouped_mm"
    return hc


class MTPHead(nn.Module):
    """vLLM's Qwen3_5MoeMTP (one layer) with canonical parameter names under ``mtp.``."""

    def __init__(self, cfg: ModelConfig, hc):
        super().__init__()
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm)

        h = cfg.hidden_size
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # any full-attention layer index builds the gated-attention variant of the layer
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(hc, cfg.full_layers[0])])
        self.norm = Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, rotary) -> torch.Tensor:
        """next_embeds: [B, T, H] embeddings of x[t+1]; hidden: [B, T, H] post-norm trunk h[t]
        at positions t = 0..T-1. Returns the post-``mtp.norm`` hidden [B, T, H]."""
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1))
        b, t, _ = u.shape
        pos = torch.arange(t)[None].expand(b, t)
        cos_sin = rotary(u, pos)
        u = self.layers[0](u, position_embeddings=cos_sin, attention_mask=None)  # sdpa: causal when no mask
        return self.norm(u)


class TinyTrainer(nn.Module):
    """transformers trunk + MTPHead; ``fast_gdn`` swaps in ``gdn_train_forward`` for the GDN mixers."""

    def __init__(self, cfg: ModelConfig, seed: int, fast_gdn: bool = True):
        super().__init__()
        from transformers import Qwen3_5MoeForCausalLM
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

        torch.manual_seed(seed)
        self.cfg = cfg
        hc = hf_text_config(cfg)
        self.trunk = Qwen3_5MoeForCausalLM(hc)
        self.mtp = MTPHead(cfg, hc)
        # same initialisation rules as the trunk (std 0.02 linears/experts, zero norm offsets)
        self.mtp.apply(self.trunk._init_weights)
        if fast_gdn:
            for m in self.trunk.modules():
                if isinstance(m, Qwen3_5MoeGatedDeltaNet):
                    m.forward = types.MethodType(gdn_train_forward, m)

    def forward(self, x: torch.Tensor, detach_hidden: bool = False):
        """x: [B, L] ids. Returns (trunk logits [B, L, V], mtp logits [B, L-1, V], router aux loss);
        mtp logits at t predict x[t+2] from (x[t+1], h[t])."""
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

        out = self.trunk.model(input_ids=x, use_cache=False, output_router_logits=True)
        h = out.last_hidden_state  # post model.norm
        logits = self.trunk.lm_head(h)
        hm = h[:, :-1].detach() if detach_hidden else h[:, :-1]
        mh = self.mtp(self.trunk.model.embed_tokens(x[:, 1:]), hm, self.trunk.model.rotary_emb)
        mtp_logits = self.trunk.lm_head(mh)
        aux = load_balancing_loss_func(out.router_logits, self.cfg.num_experts, self.cfg.num_experts_per_tok)
        return logits, mtp_logits, aux

    def canonical_params(self) -> dict[str, torch.Tensor]:
        """Parameters under model/params.py names, checked against expected_shapes."""
        sd = {k: v for k, v in self.trunk.state_dict().items()}
        sd.update({f"mtp.{k}": v for k, v in self.mtp.state_dict().items()})
        want = expected_shapes(self.cfg)
        missing = sorted(set(want) - set(sd))
        extra = sorted(set(sd) - set(want))
        if missing or extra:
            raise RuntimeError(f"canonical names: missing {missing[:5]}, unexpected {extra[:5]}")
        for k, shape in want.items():
            if tuple(sd[k].shape) != shape:
                raise RuntimeError(f"{k}: expected shape {shape}, trained tensor has {tuple(sd[k].shape)}")
        return {k: sd[k].detach().clone() for k in want}


@torch.no_grad()
def parity_check(model: TinyTrainer, ids: list[int], rtol: float = 1e-4) -> dict[str, float]:
    """The training forward must compute what decoding computes: compare its trunk and MTP
    logits on one sequence with ``model.reference.ReferenceModel`` (fp32, chunked prefill
    + MTP over every position). Raises if the relative max difference exceeds rtol."""
    from model.reference import ReferenceModel
    from model.state import DecodeState

    cfg = model.cfg
    ref = ReferenceModel(cfg, {k: v.float() for k, v in model.canonical_params().items()})
    x = torch.tensor(ids)
    was_training = model.training
    model.eval()
    logits, mtp_logits, _ = model(x[None])
    model.train(was_training)
    st = DecodeState.empty(cfg, len(ids) + 1, dtype=torch.float32)
    h = ref.trunk(x, st, 0, chunked=True)
    ref_logits, ref_mtp = ref.logits(h), ref.logits(ref.mtp(x[1:], h[:-1], st, 0))
    out = {"trunk": float((ref_logits - logits[0]).abs().max() / ref_logits.abs().max()),
           "mtp": float((ref_mtp - mtp_logits[0]).abs().max() / ref_mtp.abs().max())}
    if max(out.values()) > rtol:
        raise RuntimeError(f"parity_check: the training forward differs from model.reference by "
                           f"{out} (relative max), more than {rtol}")
    return out


def losses(model: TinyTrainer, x: torch.Tensor, detach_hidden: bool = False):
    logits, mtp_logits, aux = model(x, detach_hidden)
    v = model.cfg.vocab_size
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, v), x[:, 1:].reshape(-1))
    mtp_ce = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, v), x[:, 2:].reshape(-1))
    # teacher-forced acceptance proxy: the MTP's argmax for x[t+2] equals the trunk's
    agree = (mtp_logits[:, :-1].argmax(-1) == logits[:, 1:-1].argmax(-1)).float().mean()
    return ce, mtp_ce, aux, agree


# ---------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------


def to_shipped_dtypes(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.float32 if is_fp32_param(k) else torch.bfloat16).contiguous() for k, v in params.items()}


def save_embedded(out_dir: Path, cfg: ModelConfig, params: dict[str, torch.Tensor]) -> None:
    from model.weights import save_checkpoint

    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out_dir, cfg, to_shipped_dtypes(params))
    byte_tok.write_tokenizer_files(out_dir, cfg)


# ---------------------------------------------------------------------------
# Acceptance measurement
# ---------------------------------------------------------------------------


def measure_acceptance(ckpt_dir: Path, n_prompts: int, prompt_len: int, new_tokens: int,
                       out_json: Path | None) -> dict:
    """Greedy speculative decoding (1 MTP draft per round) of held-out prompts on the
    shipped bf16 checkpoint; also checks the committed tokens equal plain greedy decoding."""
    from harness.speculative import generate, make_decoder
    from model.weights import load_checkpoint

    # batch-1 decode ops are tiny: one thread is as fast on an idle machine and much
    # faster when other processes share the cores
    torch.set_num_threads(1)
    cfg, params = load_checkpoint(ckpt_dir, dtype=torch.bfloat16)
    variant = make_decoder("xla", cfg, params, tp=1)
    root, files = stdlib_files()
    prompts = eval_prompts(root, [f for f in files if is_held_out(f)], n_prompts, prompt_len)
    rounds = accepted = tokens = mismatches = 0
    per_prompt = []
    t0 = time.time()
    bar = tqdm(prompts, desc="acceptance", unit="prompt")
    for name, ids in bar:
        spec = generate(variant, ids, new_tokens, spec=True)
        plain = generate(variant, ids, new_tokens, spec=False)
        same = list(spec.tokens) == list(plain.tokens)
        mismatches += not same
        n_acc = sum(a - 1 for a in spec.accepted_per_round)  # drafts accepted (1 draft per round)
        rounds += spec.rounds
        accepted += n_acc
        tokens += sum(spec.accepted_per_round)
        per_prompt.append({"prompt": name, "rounds": spec.rounds, "acceptance_rate": spec.acceptance_rate,
                           "tokens_per_round": spec.tokens_per_round, "matches_plain_greedy": same})
        bar.set_postfix(acc=f"{accepted / max(rounds, 1):.3f}", tpr=f"{tokens / max(rounds, 1):.3f}")
    result = {
        "checkpoint": _display_path(ckpt_dir),
        "weights_dtype": "bfloat16 (A_log, dt_bias float32)",
        "variant": "xla (the model.tp twins at TP=1 via harness.speculative.make_decoder; prefill on model.reference)",
        "decode": "greedy, 1 MTP draft per round",
        "prompts": len(prompts),
        "prompt_bytes": prompt_len,
        "prompt_source": "held-out stdlib files (crc32(path) % 10 == 0), line start after the midpoint",
        "new_tokens_per_prompt": new_tokens,
        "rounds": rounds,
        "accepted_drafts": accepted,
        "acceptance_rate": accepted / rounds,
        "tokens_per_round": tokens / rounds,
        "spec_equals_plain_greedy": mismatches == 0,
        "prompts_differing_from_plain_greedy": mismatches,
        "seconds": round(time.time() - t0, 1),
        "command": "python scripts/train_tiny.py --eval-only",
        "per_prompt": per_prompt,
    }
    if out_json is not None:
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(result, indent=1) + "\n")
    return result


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def lr_at(step: int, steps: int, peak: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def held_out_losses(model: TinyTrainer, batches: list[torch.Tensor]) -> dict[str, float]:
    model.eval()
    sums = torch.zeros(4)
    for x in batches:
        sums += torch.tensor([float(v) for v in losses(model, x)])
    model.train()
    ce, mtp_ce, _, agree = (sums / len(batches)).tolist()
    return {"ce": ce, "mtp_ce": mtp_ce, "tf_agree": agree}


def train(args) -> dict:
    cfg = preset("tiny")
    torch.set_num_threads(2)
    # the backward of the MoE token gather (index with repeated indices) accumulates in a
    # thread-dependent order unless deterministic algorithms are requested
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    t_start = time.time()
    root, files = stdlib_files()
    train_files = [f for f in files if not is_held_out(f)]
    eval_files = [f for f in files if is_held_out(f)]
    stream = token_stream(root, train_files, cfg)
    eval_stream = token_stream(root, eval_files, cfg)
    print(f"data: {len(train_files)} train files ({stream.numel() / 1e6:.2f}M bytes), "
          f"{len(eval_files)} held-out files ({eval_stream.numel() / 1e6:.2f}M bytes) from {root}")

    g = torch.Generator().manual_seed(args.seed)
    L = args.seq_len

    def batch(src: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        off = torch.randint(0, src.numel() - L, (n,), generator=gen)
        return torch.stack([src[o:o + L] for o in off.tolist()])

    eg = torch.Generator().manual_seed(args.seed + 1)
    eval_batches = [batch(eval_stream, args.batch, eg) for _ in range(args.eval_batches)]

    model = TinyTrainer(cfg, args.seed, fast_gdn=not args.hf_gdn)
    model.train()
    check_ids = eval_stream[:150].tolist()  # crosses a GDN chunk boundary, not a multiple of 64
    print(f"parity of the training forward with model.reference (relative max diff): "
          f"{parity_check(model, check_ids)}")
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    curve = []
    bar = tqdm(range(args.steps), desc="train", unit="step")
    ema = None
    for step in bar:
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.final_lr_frac)
        for group in opt.param_groups:
            group["lr"] = lr
        x = batch(stream, args.batch, g)
        ce, mtp_ce, aux, agree = losses(model, x, args.detach_hidden)
        loss = ce + args.mtp_weight * mtp_ce + args.aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        cur = torch.tensor([ce.item(), mtp_ce.item(), agree.item()])
        ema = cur if ema is None else 0.95 * ema + 0.05 * cur
        bar.set_postfix(loss=f"{ema[0]:.3f}", mtp=f"{ema[1]:.3f}", agree=f"{ema[2]:.3f}", lr=f"{lr:.1e}")
        last = step == args.steps - 1
        if (step + 1) % args.eval_every == 0 or last:
            ev = held_out_losses(model, eval_batches)
            rec = {"step": step + 1, "minutes": round((time.time() - t_start) / 60, 2),
                   "train_ce": round(float(ema[0]), 4), "train_mtp_ce": round(float(ema[1]), 4),
                   "heldout_ce": round(ev["ce"], 4), "heldout_mtp_ce": round(ev["mtp_ce"], 4),
                   "heldout_tf_agree": round(ev["tf_agree"], 4)}
            curve.append(rec)
            tqdm.write(json.dumps(rec))
        if args.max_minutes and time.time() - t_start > 60 * args.max_minutes:
            tqdm.write(f"stopping at step {step + 1}: --max-minutes {args.max_minutes} reached")
            break
    train_seconds = time.time() - t_start
    print(f"parity after training: {parity_check(model, check_ids)}")
    params = model.canonical_params()
    return {"cfg": cfg, "params": params, "curve": curve, "train_seconds": train_seconds,
            "loadavg": os.getloadavg()[1],
            "steps_done": step + 1, "train_files": len(train_files), "eval_files": len(eval_files),
            "train_bytes": stream.numel(), "stdlib": str(root)}


def _display_path(p: Path) -> str:
    p = p.resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def model_card(args, info: dict, acc: dict, total_seconds: float, size_mb: float) -> str:
    curve = info["curve"]
    final = curve[-1]
    rows = "\n".join(f"| {r['step']} | {r['minutes']} | {r['train_ce']} | {r['train_mtp_ce']} | "
                     f"{r['heldout_ce']} | {r['heldout_mtp_ce']} | {r['heldout_tf_agree']} |" for r in curve)
    tokens_seen = info["steps_done"] * args.batch * args.seq_len
    return f"""# Embedded tiny model (Qwen3.6 architecture, `tiny` preset)

The default model of `make decode`: every structural feature of Qwen3.6-35B-A3B at
toy size (8 layers, 3:1 Gated DeltaNet / gated attention, 16-expert top-4 MoE with
a shared expert, partial RoPE, GQA, one MTP layer), with a **trained** MTP head so
that speculative decoding really accepts drafts. Byte-level vocabulary
(256 bytes, `<|bos|>`=256, `<|eos|>`=257, `<|pad|>`=258, reserved up to 272).

## Data
Python {sys.version_info.major}.{sys.version_info.minor} standard library `.py` sources
(`sysconfig.get_paths()["stdlib"]`, test suites and site-packages excluded),
sorted by path; files with `crc32(path) % 10 == 0` are held out
({info['eval_files']} files), the other {info['train_files']} files
({info['train_bytes'] / 1e6:.1f} MB) are the training text. Each file is
`<|bos|> bytes <|eos|>`; batches are random {args.seq_len}-byte windows (seed {args.seed}).

## Training
{info['steps_done']} steps x {args.batch} x {args.seq_len} bytes ({tokens_seen / 1e6:.2f}M tokens),
AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak lr {args.lr}, {args.warmup} warmup steps,
cosine to {args.final_lr_frac} x peak, grad clip {args.clip}; fp32 on CPU, 2 threads.
Loss = trunk CE + {args.mtp_weight} x MTP CE + {args.aux_weight} x router load-balancing loss.
The MTP head predicts x[t+2] from (x[t+1], post-`model.norm` trunk hidden h[t]) exactly as decoding
runs it; its loss is {'detached from' if args.detach_hidden else 'back-propagated into'} the trunk.
Training time {info['train_seconds'] / 60:.1f} min ({info['train_seconds'] / info['steps_done']:.1f} s/step); total with
saving and evaluation {total_seconds / 60:.1f} min, with a 5-minute load average of {info['loadavg']:.1f} at the end
of training (other processes sharing the 2 cores stretch the wall time).

| step | min | train CE | train MTP CE | held-out CE | held-out MTP CE | teacher-forced agreement |
|---|---|---|---|---|---|---|
{rows}

CE in nats per byte. "Agreement" is the fraction of held-out positions where the MTP's
argmax for x[t+2] equals the trunk's (the acceptance test, on reference text).

Final: held-out trunk CE {final['heldout_ce']} nats/byte ({final['heldout_ce'] / math.log(2):.2f} bits/byte),
held-out MTP CE {final['heldout_mtp_ce']}.

## Measured acceptance (shipped bf16 weights)
Greedy speculative decoding with one MTP draft per round (`harness.speculative.generate`,
xla variant), {acc['prompts']} held-out prompts x {acc['new_tokens_per_prompt']} new tokens:
**acceptance {acc['acceptance_rate']:.3f}, {acc['tokens_per_round']:.3f} tokens per round**
({acc['rounds']} rounds). Speculative output equals plain greedy decoding on every prompt:
{acc['spec_equals_plain_greedy']}. Details: `bench/tiny_acceptance.json`.

## Known limitations
A 5M-parameter byte model after {tokens_seen / 1e6:.1f}M tokens: continuations are Python-shaped but
repetitive (`self._context...`), and after a top-level `def f(...):` line plus a 4-space indent,
greedy decoding indents forever (a run of spaces, which every draft predicts). Prompts in the middle of a
class or module give more varied text.

## Files
`config.json` (text-only `qwen3_5_moe_text`), `model.safetensors` (bf16; `A_log`, `dt_bias` fp32;
{size_mb:.1f} MB total directory), `tokenizer.json` + `tokenizer_config.json` (byte-level;
`AutoTokenizer.from_pretrained(dir)` loads it; `model/tokenizer.py` is the same mapping in Python).

## Regenerate
    python scripts/train_tiny.py              # train + save + measure ({total_seconds / 60:.0f} min in the run above)
    python scripts/train_tiny.py --eval-only  # re-measure acceptance of the shipped checkpoint
The run is seeded and deterministic for a given Python stdlib, torch version and CPU type.
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval-only", action="store_true", help="only measure acceptance of the shipped checkpoint")
    ap.add_argument("--out", type=Path, default=EMBEDDED_DIR, help="checkpoint directory")
    ap.add_argument("--bench-json", type=Path, default=BENCH_JSON)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--final-lr-frac", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=1.0)
    ap.add_argument("--aux-weight", type=float, default=0.01)
    ap.add_argument("--detach-hidden", action="store_true", help="stop the MTP loss gradient at h[t]")
    ap.add_argument("--hf-gdn", action="store_true",
                    help="train with transformers' own GDN forward instead of gdn_train_forward (slower)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--max-minutes", type=float, default=0.0, help="safety stop (0 = none)")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-measure", action="store_true", help="train and save only")
    args = ap.parse_args(argv)

    if args.eval_only:
        acc = measure_acceptance(args.out, args.prompts, args.prompt_len, args.new_tokens, args.bench_json)
        print(json.dumps({k: v for k, v in acc.items() if k != "per_prompt"}, indent=1))
        return

    t0 = time.time()
    info = train(args)
    save_embedded(args.out, info["cfg"], info["params"])
    (args.out / "training_log.json").write_text(json.dumps(
        {"args": {k: _display_path(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
         "curve": info["curve"], "train_seconds": round(info["train_seconds"], 1),
         "steps_done": info["steps_done"]}, indent=1) + "\n")
    if args.no_measure:
        return
    acc = measure_acceptance(args.out, args.prompts, args.prompt_len, args.new_tokens, args.bench_json)
    total = time.time() - t0
    size_mb = sum(p.stat().st_size for p in args.out.iterdir()) / 1e6
    (args.out / "MODEL_CARD.md").write_text(model_card(args, info, acc, total, size_mb))
    print(json.dumps({k: v for k, v in acc.items() if k != "per_prompt"}, indent=1))
    print(f"total {total / 60:.1f} min, checkpoint {size_mb:.1f} MB in {args.out}")


if __name__ == "__main__":
    main()
