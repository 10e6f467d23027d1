"""Teacher-forced logits of any variant, and where a free-running decode first leaves a reference sequence.

Both the numerics robustness report (``harness.robustness``) and the chip bring-up check
(``harness.nxdi.check``) compare a variant with the CPU reference position by position on the SAME inputs:
the prompt, then a fixed continuation (the reference's greedy tokens) fed to both whatever each predicts --
teacher forcing, as NxDI's logit validation does (neuronx-distributed-inference
``experimental/core/accuracy/logit_validation.py`` 0.9.0, docstring "Teacher Forcing for Fair Comparison").

The device side is driven only through the decoder interface (``prefill`` / ``round`` / ``step`` / ``commit``,
``harness.speculative.Decoder``), so every variant -- layerwise, megakernel, an NxDI engine -- runs the same way:

* ``prefill(prompt)`` gives the prediction for continuation[0] (and the hidden there);
* then rounds with the variant's K drafts (``drafts``, 1 when it does not say) FORCED to the next K continuation
  tokens and all K + 1 verified tokens committed (a K-token accept): a round at the position of continuation[k-1]
  predicts continuation[k] .. continuation[k+K]; near the end fewer drafts are forced, and a last single
  prediction is a ``step``. N predictions cost 1 prefill + about N/(K+1) launches.

The reference is the single-device PyTorch model (``model.reference.ReferenceModel``), decoded token by token
(:func:`reference_run`): plain greedy decoding, the truth every kernel is a twin of.

Logits: the variants return the post-final-norm hidden of every position (and the kernels' own greedy ids),
not logits. The cheapest honest logits are the host's: ``hidden @ lm_head.T`` in fp32 with the checkpoint's
weights. They carry every error of the trunk up to the hidden; the LM head's own matmul is then the host's, so
the kernel's argmax is checked separately: its id must be a top-1 of those logits up to the observed error
(``Forced.targets`` beside ``Forced.hidden``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.speculative import generate

# Prompts of the embedded model (byte-level vocabulary; it was trained on Python standard-library sources).
TEXT_PROMPTS = (
    "def fib(n):\n    ",
    "import os\n",
    "class Stack:\n",
    "for i in range(",
    "return self._",
    "raise ValueError(",
    "if x is None:\n",
    "# Copyright ",
)


@dataclass
class Forced:
    """A teacher-forced run: prediction j is for ``continuation[j]`` given ``prompt + continuation[:j]``."""

    prompt: list[int]
    continuation: list[int]
    targets: list[int]          # [N] the variant's own greedy ids
    hidden: torch.Tensor        # [N, H] post-norm hidden (float32) at the position before each prediction

    def logits(self, head: torch.Tensor) -> torch.Tensor:
        """[N, V] float32 host logits (``head``: [V, H] LM-head weight)."""
        return host_logits(self.hidden, head)


def head_weight(cfg, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The checkpoint's LM-head weight [V, H] as float32 (tied to the embedding when the config says so)."""
    name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return params[name].float()


def host_logits(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] -> logits [N, V], float32 (one matmul, the same for every variant compared)."""
    return hidden.float() @ head.T


def reference_run(cfg, params: dict[str, torch.Tensor], prompt: list[int], new_tokens: int
                  ) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding of ``new_tokens`` after ``prompt`` with the single-device reference, one token at a time:
    (the greedy tokens, post-norm hidden [len(prompt) + new_tokens - 1, H] float32), ``hidden[t]`` at position t,
    the one that predicts token t + 1 of prompt + tokens."""
    from model.reference import ReferenceModel
    from model.state import DecodeState
    if not prompt or new_tokens < 1:
        raise ValueError("reference_run: the prompt must be non-empty and new_tokens >= 1")
    ref = ReferenceModel(cfg, params)
    head = head_weight(cfg, params)
    state = DecodeState.empty(cfg, len(prompt) + new_tokens + 1, slots=2, dtype=ref.dtype)
    seq, hiddens = list(prompt), []
    with torch.no_grad():
        for t in range(len(prompt) + new_tokens - 1):
            h = ref.trunk(torch.tensor([seq[t]]), state, t, chunked=False)
            state.commit(1)
            hiddens.append(h[0].float())
            if t + 1 >= len(seq):
                seq.append(int(host_logits(h, head).argmax(dim=-1)[0]))
    return seq[len(prompt):], torch.stack(hiddens)


def forced_run(variant, prompt: list[int], continuation: list[int], rounds: bool = True) -> Forced:
    """Teacher-force ``variant`` (a ``harness.speculative.Decoder``) through ``prompt + continuation`` (module
    docstring: rounds of the variant's K forced drafts, K + 1 tokens committed); ``rounds=False`` uses one ``step``
    per position instead."""
    if not prompt or not continuation:
        raise ValueError("forced_run: the prompt and the continuation must be non-empty")
    n, p = len(continuation), len(prompt)
    K = getattr(variant, "drafts", 1)
    first, hidden = variant.prefill(prompt, max_len=p + n + K)
    targets, hiddens = [int(first)], [hidden.float()]
    while len(targets) < n:
        k = len(targets)                       # next prediction is for continuation[k]
        pending, pos = continuation[k - 1], p + k - 1
        j = min(K, n - 1 - k) if rounds else 0  # drafts forced to continuation[k : k+j]
        if j >= 1:
            r = variant.round(pending, hiddens[-1], pos, continuation[k:k + j])
            variant.commit(j + 1)
            targets += [int(t) for t in r.targets[:j + 1]]
            hiddens += [h.float() for h in r.hidden[:j + 1]]
        else:
            tok, h = variant.step(pending, pos)
            targets.append(int(tok))
            hiddens.append(h.float())
    return Forced(list(prompt), list(continuation), targets, torch.stack(hiddens))


class _Diverged(Exception):
    pass


def first_divergence(variant, prompt: list[int], reference: list[int], spec: bool = True) -> int | None:
    """Free-running greedy decode (``harness.speculative.generate``, MTP drafts when ``spec``) compared with the
    reference tokens: the index of the first generated token that differs, or None if all ``len(reference)``
    agree. Stops at the first difference."""
    seen: list[int] = []

    def check(tokens):
        for tok in tokens:
            if len(seen) < len(reference) and tok != reference[len(seen)]:
                raise _Diverged
            seen.append(tok)

    try:
        generate(variant, prompt, len(reference), spec=spec, on_tokens=check)
    except _Diverged:
        return len(seen)
    return None
