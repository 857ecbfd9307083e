"""Verifying several drafts of one node: SpecTr's k-sequential selection, generalised to drafts of
different SSMs, and the choice between it and multi-step speculative sampling (ALGORITHMS.md
sections 2 and 15). `decoder/verify.py` (`verify_k_sequential`) walks the tree with these plans.

Setting. At one tree node the LLM's distribution is p. The node's children carry k proposals,
taken in a fixed order i = 1..k that does not depend on the drawn tokens (by SSM, then by the
SSM's chain: `Proposal.draw`). Proposal i is a token X_i drawn from its own q_i, the draws
independent of each other and of the verifier's uniforms U_1..U_k. A rule of the family F is given
by acceptance functions a_i: V -> [0, 1] and a fallback distribution R, all computed from p and
q_1..q_k only (never from the X_i): for i = 1..k, accept X_i and stop if U_i < a_i(X_i); if no
proposal is accepted, emit Y ~ R.

Lemma 1 (what a rule of F emits). Let alpha_j = sum_x q_j(x) a_j(x) and w_i = prod_{j<i} (1 -
alpha_j). Then P(the rule emits x by accepting proposal i) = w_i q_i(x) a_i(x).
Proof: "proposal j is rejected" is an event of (X_j, U_j) alone, of probability 1 - alpha_j;
these pairs are independent, so every earlier proposal is rejected with probability w_i, and
independently of that, X_i = x and U_i < a_i(x) with probability q_i(x) a_i(x). []

Theorem 2 (when a rule of F is lossless). Let S(x) = sum_i w_i q_i(x) a_i(x) and W = prod_i (1 -
alpha_i) (the probability that no proposal is accepted). The output is distributed as p if and
only if S(x) + W R(x) = p(x) for every x. The sums telescope: sum_x S(x) = sum_i w_i alpha_i =
sum_i (w_i - w_{i+1}) = 1 - W, so sum_x (p(x) - S(x)) = W. Hence:
  - if S(x) <= p(x) for every x and W > 0, the fallback R(x) = (p(x) - S(x)) / W is a
    distribution and the rule is lossless;
  - if W = 0, S sums to 1 = sum p, and S <= p forces S = p: lossless, the fallback never runs;
  - if S(x) > p(x) for some x, no fallback can repair it (R >= 0): the rule emits x too often.
So a rule of F is lossless exactly when S <= p everywhere and R is that residual, and its total
acceptance is 1 - W = 1 - prod_i (1 - alpha_i). []

Corollary 3 (k-sequential selection, generalised). For rho >= 1 let m_i = min(q_i, p / rho) and
a_i(x) = m_i(x) / q_i(x) = min(1, p(x) / (rho q_i(x))) (0 where q_i(x) = 0: X_i never equals such
an x), so q_i a_i = m_i, alpha_i = sum m_i and S = sum_i w_i m_i.
  - When every q_i is one q (SpecTr: k i.i.d. drafts), m_i = m, alpha_i = beta = sum m, w_i =
    (1 - beta)^(i - 1), so S = c m with c = (1 - (1 - beta)^k) / beta and R(x) = (p(x) - c m(x)) /
    (1 - beta)^k: SpecTr's rule exactly. SpecTr's condition c <= rho implies S = c m <= rho m <=
    p; we check S <= p itself, on every token, which is the exact condition of Theorem 2 (it may
    admit a smaller rho than c <= rho does).
  - rho = k is always feasible: w_i <= 1, so S <= sum_i m_i <= k p / k = p.
  - rho = 1, k = 1: a = min(1, p / q), R = norm(max(p - q, 0)), ordinary speculative sampling.
  - A smaller rho makes every m_i, hence every alpha_i and the acceptance 1 - W, larger, so we
    want the smallest feasible rho. Feasibility need not be monotone in rho for different q_i,
    so the search never relies on it: it keeps the invariant that `hi` is feasible (checked on
    every token; the start, rho = k, is feasible by the bullet above) and `lo` is not, tries
    POINTS points between them at once (one device read per round; one point, plain bisection,
    on the CPU for a large vocabulary, where every point costs its own work), moves `hi` to the
    first feasible one and `lo` to the point before, until hi - lo <= RHO_RESOLUTION, and uses
    `hi`.

Corollary 4 (MSS is in F). Multi-step speculative sampling (SpecInfer) starts from r_1 = p and
accepts X_i with a_i = min(1, r_i / q_i), where r_{i+1} = norm(max(r_i - q_i, 0)), and falls back
to r_{k+1}: every a_i and the fallback depend on p and the q's only, so Lemma 1 gives its exact
acceptance 1 - prod_i (1 - alpha_i), and it is lossless (SpecInfer, Theorem 4.2; checked exactly
in tests/test_sampling_lossless.py).

Corollary 5 (choosing a rule per node). A choice between lossless rules of F that depends only on
p and q_1..q_k (not on the X_i or the U_i) is lossless: given the choice, the output is p. So at
every node we compute both rules' exact total acceptance and use the larger (`best_plan`); the
rule then never accepts less than MSS at a node. In a tree the same holds node by node: when
verification reaches node u, the proposals at u's children are the next draws of the chains that
pass through u, made from their q's at u independently of everything that decided to accept u,
and their number, q's and order are fixed by the path to u; so each step emits p(. | path) and
the output has the LLM's joint distribution (ALGORITHMS.md section 2).

Numerics: float64 throughout; S <= p is checked with a relative slack of FEASIBLE_SLACK (rounding of
sums of k terms), and p - S is clamped at 0 before normalising; p or q with zeros (top-k, top-p)
need nothing special (m_i = 0 where p = 0; a_i = 0 where q_i = 0), and the plans are computed on
the tokens where p or some q_i is positive only (elsewhere every a_i, S and R are 0); beta = 0
(disjoint supports) gives S = 0 and R = p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

FEASIBLE_SLACK = 1e-12  # S(x) <= p(x) (1 + slack): float64 rounding of k-term sums, far below float32 p
RHO_RESOLUTION = 1e-3  # the search stops when the bracket is this narrow (acceptance lost: ~1e-4)
POINTS = 7  # rho values tried per round (one device read each) ...
CPU_BISECTION_TOKENS = 2048  # ... but one (plain bisection) on the CPU for more tokens than this
_TINY = 1e-300  # denominators where q = 0 (the result is masked there)


@dataclass
class NodePlan:
    """How one node's proposals are verified: proposal i (in order) is accepted with probability
    `accept[i][x]` if it drew x; if none is accepted, the emitted token is drawn from `residual`."""

    accept: list[torch.Tensor]  # [V] per proposal, float64
    residual: torch.Tensor  # [V] float64
    acceptance: float  # exact probability over the draws that some proposal is accepted
    rule: str  # "k_sequential", "mss" or "none" (no proposals)
    rho: float | None = None  # k_sequential's rho


def _ratio(num: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, num / q) where q > 0, else 0."""
    return torch.where(q > 0, torch.clamp(num / q.clamp(min=_TINY), max=1.0), torch.zeros_like(q))


def _finish(
    p: torch.Tensor, qs: Sequence[torch.Tensor], accept: list[torch.Tensor]
) -> tuple[torch.Tensor, float]:
    """Theorem 2: the fallback (p - S) / W (clamped, normalised; p where nothing is left, a
    fallback reached with probability 0) and the total acceptance 1 - W of a rule of F."""
    s, w = torch.zeros_like(p), torch.ones((), dtype=p.dtype, device=p.device)
    for q, a in zip(qs, accept, strict=True):
        m = q * a
        s = s + w * m
        w = w * (1 - m.sum())
    left = torch.clamp(p - s, min=0)
    total = left.sum()
    residual = left / total if float(total) > 0 else p
    return residual, 1.0 - float(w)


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """MSS's R <- norm(max(R - q, 0)) (ALGORITHMS.md section 2); keeps R if the difference vanishes
    (then q == R and the proposal was accepted)."""
    diff = torch.clamp(r - q, min=0)
    total = diff.sum()
    return diff / total if total > 0 else r


def mss_plan(p: torch.Tensor, qs: Sequence[torch.Tensor]) -> NodePlan:
    """Multi-step speculative sampling as a rule of F (Corollary 4); float64."""
    p, qs = p.double(), [q.double() for q in qs]
    r, accept = p, []
    for q in qs:
        accept.append(_ratio(r, q))
        r = residual(r, q)
    _, acceptance = _finish(p, qs, accept)
    return NodePlan(accept, r, acceptance, "mss")


def _feasible(p: torch.Tensor, qs: Sequence[torch.Tensor], rhos: torch.Tensor) -> list[bool]:
    """Per rho: S <= p on every token (Theorem 2), S of the k-sequential rule (Corollary 3)."""
    s = torch.zeros(len(rhos), p.numel(), dtype=p.dtype, device=p.device)
    w = torch.ones(len(rhos), dtype=p.dtype, device=p.device)
    bound = p[None] / rhos[:, None]  # [G, V]
    for q in qs:
        m = torch.minimum(q[None], bound)
        s += w[:, None] * m
        w = w * (1 - m.sum(-1))
    return (s <= p[None] * (1 + FEASIBLE_SLACK)).all(-1).tolist()


def smallest_feasible_rho(p: torch.Tensor, qs: Sequence[torch.Tensor]) -> float | None:
    """The smallest rho in [1, k] (to RHO_RESOLUTION) at which the k-sequential rule is lossless,
    checked on every token; None if even rho = k fails the check (rounding; never seen). Float64."""
    k = len(qs)
    if k == 1:
        return 1.0  # m = min(q, p) <= p exactly
    ends = _feasible(p, qs, torch.tensor([1.0, float(k)], dtype=p.dtype, device=p.device))
    if ends[0]:
        return 1.0
    if not ends[1]:
        return None
    points = 1 if p.device.type == "cpu" and p.numel() > CPU_BISECTION_TOKENS else POINTS
    lo, hi = 1.0, float(k)  # lo infeasible, hi feasible
    while hi - lo > RHO_RESOLUTION:
        step = (hi - lo) / (points + 1)
        values = [lo + step * (i + 1) for i in range(points)]
        ok = _feasible(p, qs, torch.tensor(values, dtype=p.dtype, device=p.device))
        if True in ok:
            first = ok.index(True)
            lo, hi = (values[first - 1] if first else lo), values[first]
        else:
            lo = values[-1]
    return hi


def k_sequential_plan(p: torch.Tensor, qs: Sequence[torch.Tensor]) -> NodePlan | None:
    """The k-sequential rule of Corollary 3 at the smallest feasible rho; None where no rho passes
    the check. Float64."""
    p, qs = p.double(), [q.double() for q in qs]
    rho = smallest_feasible_rho(p, qs)
    if rho is None:
        return None
    accept = [_ratio(p / rho, q) for q in qs]
    residual, acceptance = _finish(p, qs, accept)
    return NodePlan(accept, residual, acceptance, "k_sequential", rho)


def best_plan(p: torch.Tensor, qs: Sequence[torch.Tensor]) -> NodePlan:
    """The k-sequential rule or MSS, whichever accepts more at this node (Corollary 5): the
    choice depends on p and the q's only, so it stays lossless. Computed on the tokens where p or
    some q is positive (all of them, or the few that top-k / top-p leave)."""
    p = p.double()
    if not qs:
        return NodePlan([], p, 0.0, "none")
    qs = [q.double() for q in qs]
    support = p > 0
    for q in qs:
        support |= q > 0
    index = support.nonzero().squeeze(1)
    if len(index) == len(p):
        return _better_plan(p, qs)
    plan = _better_plan(p[index], [q[index] for q in qs])
    return NodePlan(
        [_widen(a, index, p) for a in plan.accept],
        _widen(plan.residual, index, p),
        plan.acceptance,
        plan.rule,
        plan.rho,
    )


def _widen(values: torch.Tensor, index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`values` at the tokens `index`, zeros elsewhere (shaped as `like`)."""
    return torch.zeros_like(like).index_copy(0, index, values)


def _better_plan(p: torch.Tensor, qs: list[torch.Tensor]) -> NodePlan:
    if len(qs) == 1:  # both are speculative sampling: accept min(1, p / q), fall back to max(p - q, 0)
        return k_sequential_plan(p, qs)
    mss = mss_plan(p, qs)
    k_sequential = k_sequential_plan(p, qs)
    if k_sequential is not None and k_sequential.acceptance >= mss.acceptance:
        return k_sequential
    return mss
