"""Distribution losses against a stored top-K of p with the tail as one bucket (ALGORITHMS.md
section 15, "Distribution distillation"), and the acceptance they imply.

p is stored per position as its top-K probabilities p_1..p_K (token ids x_1..x_K) and the tail
mass p_tail (training/target_distributions.py). q = softmax(z / T) is the SSM's distribution, with
T the temperature p was recorded at. Section 15's bucketed forms, with q_tail = 1 - sum_k q(x_k)
(the mass q puts on the same tokens' complement):

    KL_b(p || q) = sum_k p_k log(p_k / q(x_k)) + p_tail log(p_tail / q_tail)
    TV_b(p, q)   = 1/2 (sum_k |p_k - q(x_k)| + |p_tail - q_tail|)

Derived here (section 15 does not state these):

- Both are lower bounds of the full-vocabulary values. KL: by the log-sum inequality,
  sum_{x in tail} p(x) log(p(x) / q(x)) >= p_tail log(p_tail / q_tail). TV: by the triangle
  inequality, sum_{x in tail} |p(x) - q(x)| >= |p_tail - q_tail|. Equality holds when the tail is
  empty (K = V), and for TV whenever p - q has one sign on the whole tail, in particular when
  p_tail = 0 (a top-p / top-k cut inside the stored K): then the tail term is q_tail exactly. So
  the acceptance estimate 1 - TV_b is an UPPER bound of the true one-token acceptance 1 - TV.
- Gradient of KL_b with respect to the logits (sum_k p_k + p_tail = 1):
  dKL_b / dz_i = (q_i - t_i) / T with t_i = p_i for the stored tokens and t_i = p_tail q_i / q_tail
  for the tail tokens: the stored tokens are matched one by one, and the tail's mass is moved to
  p_tail as a whole, spread in proportion to q inside it.
- Why q at the SAME temperature as p: the decoder processes SSM logits with the serving warpers
  (ALGORITHMS.md section 2), so the q that sets the acceptance at serving time is softmax(z / T).
  Fitting softmax(z / T) to p_T trains that q; fitting softmax(z) to p_T would serve
  softmax(z / T), which for T < 1 is sharper than p_T. A top-p / top-k cut of q at serving time
  is not modelled (it is not differentiable); p is zero outside its own cut, so training moves q's
  mass inside it and the cut removes little.
- `mix` = CE + w KL_b (`--mix-weight` w): the cross-entropy on the LLM's token (at T = 1, as the
  plain CE loss) keeps q's argmax on the LLM's token (greedy acceptance); KL_b shapes the rest.

Numerics: log q = log_softmax(z / T); log q_tail is a logsumexp over the tail tokens' log q with
one constant entry log(TAIL_FLOOR) added, so an empty tail (K = V) gives a finite log with a finite
gradient instead of log(0); p log p is `xlogy` (0 for p = 0).
"""

from __future__ import annotations

import math

import torch

LOSSES = ("ce", "kl", "tv", "mix")
TAIL_FLOOR = 1e-30  # added to q_tail inside the log: a smooth clamp of log(0)


def tail_log_q(log_q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N] log q_tail = log(sum of q over the tokens outside `ids` + TAIL_FLOOR).
    log_q: [N, V]; ids: [N, K] long (distinct per row)."""
    outside = log_q.scatter(-1, ids, float("-inf"))  # [N, V]
    floor = torch.full_like(log_q[:, :1], math.log(TAIL_FLOOR))
    return torch.logsumexp(torch.cat([outside, floor], dim=-1), dim=-1)


def bucketed_kl(
    logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, tail: torch.Tensor, temperature: float
) -> torch.Tensor:
    """[N] KL_b(p || softmax(logits / T)) per position.
    logits: [N, V]; ids: [N, K] long; probs: [N, K]; tail: [N]."""
    log_q = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs, tail = probs.float(), tail.float()
    top = torch.xlogy(probs, probs) - probs * log_q.gather(-1, ids)  # [N, K]
    rest = torch.xlogy(tail, tail) - tail * tail_log_q(log_q, ids)  # [N]
    return top.sum(-1) + rest


def bucketed_tv(
    logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, tail: torch.Tensor, temperature: float
) -> torch.Tensor:
    """[N] TV_b(p, softmax(logits / T)) per position (same shapes as `bucketed_kl`)."""
    log_q = torch.log_softmax(logits.float() / temperature, dim=-1)
    top = (probs.float() - log_q.gather(-1, ids).exp()).abs().sum(-1)  # [N]
    rest = (tail.float() - tail_log_q(log_q, ids).exp()).abs()
    return 0.5 * (top + rest)


def sampled_acceptance(
    logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, tail: torch.Tensor, temperature: float
) -> torch.Tensor:
    """[N] 1 - TV_b: the acceptance of one draft token sampled from q (an upper bound, see above)."""
    return 1.0 - bucketed_tv(logits, ids, probs, tail, temperature)


def position_losses(
    loss: str,
    logits: torch.Tensor,  # [N, V]: the SSM's logits at the trained positions
    labels: torch.Tensor,  # [N]: the LLM's tokens there
    targets: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # (ids, probs, tail) of p
    temperature: float | None,
    mix_weight: float = 1.0,
) -> torch.Tensor:
    """[N] per-position loss of kind `loss` (LOSSES)."""
    if loss == "ce":
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
    if targets is None or temperature is None:
        raise ValueError(f"loss {loss!r} needs the stored distributions of p")
    if loss == "kl":
        return bucketed_kl(logits, *targets, temperature)
    if loss == "tv":
        return bucketed_tv(logits, *targets, temperature)
    if loss == "mix":
        ce = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        return ce + mix_weight * bucketed_kl(logits, *targets, temperature)
    raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
