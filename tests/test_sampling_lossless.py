"""Sampling through `SpeculativeDecoder` is lossless: its output has the LLM's distribution.

Three layers of evidence (ALGORITHMS.md section 2):

1. Exact algebra, no randomness: for hand-made p and q, the probability that one verification
   step emits token x (accepted child or correction), summed over every way the children can be
   drawn, equals p(x) for MSS (one or several proposals, from one or several q), for sampling
   without replacement and for the k-sequential rule (`decoder/multi_draft.py`: SpecTr's rule,
   its generalisation to different q's, and the per-node choice between it and MSS), whose exact
   acceptance is also checked against MSS's. Uses the library's own `residual` and plans.
2. The rules in `decoder/verify.py` on hand-built `TokenTree`s (no models), sampled many times
   with a `torch.Generator` and compared with p by a chi-square goodness-of-fit test; plus the
   properties Sequoia proves (k=1 acceptance = 1 - ||p - q||_1 / 2; without replacement with
   children covering the support always accepts); the k-sequential rule's measured acceptance
   against MSS's on the same trees.
3. End to end: a tiny-vocabulary LLM and 1-2 different SSMs, `SpeculativeDecoder.generate`
   called E2E_SAMPLES (600) times per configuration with distinct seeds, and the joint
   distribution of the generated tokens compared with the exact one, P(t1, t2[, t3]) =
   p(t1 | prompt) p(t2 | prompt, t1) ..., enumerated with the LLM itself (plain causal forward,
   same logits warpers). Speculation is checked to be non-trivial (drafts get accepted).

Statistics: chi-square goodness of fit (`scipy.stats.chisquare`) with cells of expected count
< 5 merged; a correct rule must give p-value >= ALPHA = 0.001. Every sample uses a fixed seed,
so the p-values are deterministic (no flakiness); for a fresh choice of seeds a correct
implementation would fail a check by chance with probability 0.001. The same harness
must REJECT deliberately wrong rules (accept every draft; MSS without the residual
renormalisation; the k-sequential rule without its feasibility check, or accepting as plain
speculative sampling does but falling back to the k-sequential residual) with p-value < 1e-6,
which shows it has the power to catch real mistakes.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from conftest import tiny_llama
from scipy import stats
from test_scheduler import SPECULATE, VERIFY, constant_predictor, cost_table

from specboost.decoder import (
    BeamShape,
    ChainShape,
    Rule,
    SpeculativeDecoder,
    StrategyOptions,
    TopologyShape,
    multi_draft,
    verify,
)
from specboost.decoder.multi_draft import NodePlan, best_plan, k_sequential_plan, mss_plan
from specboost.decoder.verify import (
    Verdict,
    verify_k_sequential,
    verify_mss,
    verify_target,
    verify_without_replacement,
)
from specboost.speculator import sampling
from specboost.speculator.routed_scheduler import SAMPLED, SEEDED
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.tree import DraftKind, TokenTree

ALPHA = 1e-3  # significance level of every goodness-of-fit check of a correct rule
WRONG_P = 1e-6  # a wrong rule must be rejected at least this strongly
MIN_EXPECTED = 5.0  # chi-square cells with a smaller expected count are merged

VOCAB = 6  # tiny vocabulary: 36 cells for pairs, 216 for triples
PROMPT = [0, 4, 2]


@pytest.fixture(scope="module", autouse=True)
def _single_thread() -> Iterator[None]:
    """Tiny models are pure overhead; extra intra-op threads only fight over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Statistics --------------------------------------------------------------------------------------
def gof_pvalue(counts: Counter, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of `counts` (cell index tuple -> count) to `probs` ([V] * n).

    Cells are sorted by expected count and adjacent ones merged until every merged cell expects
    >= MIN_EXPECTED. An observation in a cell of probability 0 is impossible: p-value 0.
    """
    probs = probs.double()
    n = sum(counts.values())
    observed = torch.zeros_like(probs)
    for cell, count in counts.items():
        observed[cell] = count
    observed, probs = observed.flatten().numpy(), probs.flatten().numpy()
    if observed[probs <= 0].sum() > 0:
        return 0.0
    keep = probs > 0
    expected, observed = probs[keep] / probs[keep].sum() * n, observed[keep]
    order = np.argsort(expected, kind="stable")
    merged_obs, merged_exp, acc_obs, acc_exp = [], [], 0.0, 0.0
    for i in order:
        acc_obs, acc_exp = acc_obs + observed[i], acc_exp + expected[i]
        if acc_exp >= MIN_EXPECTED:
            merged_obs.append(acc_obs)
            merged_exp.append(acc_exp)
            acc_obs, acc_exp = 0.0, 0.0
    if acc_exp > 0:  # leftover small cells join the last (largest) merged cell
        if merged_exp:
            merged_obs[-1] += acc_obs
            merged_exp[-1] += acc_exp
        else:
            merged_obs, merged_exp = [acc_obs], [acc_exp]
    if len(merged_exp) < 2:
        return 1.0
    pvalue = float(stats.chisquare(merged_obs, merged_exp).pvalue)
    print(f"chi-square: {n} samples, {len(merged_exp)} cells, p-value {pvalue:.3g}")
    return pvalue


def marginal(counts: Counter, length: int) -> Counter:
    """Counts of the first `length` tokens."""
    out: Counter = Counter()
    for cell, count in counts.items():
        out[cell[:length]] += count
    return out


# Rules that must FAIL -----------------------------------------------------------------------------
def accept_every_draft(tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
    """WRONG: accepts the first child at every node, whatever p says (output follows q, not p)."""
    node, accepted = 0, []
    while tree.children[node]:
        node = tree.children[node][0]
        accepted.append(node)
    return Verdict(accepted, int(torch.multinomial(p[node], 1, generator=generator)))


def _no_residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """WRONG residual: keeps p instead of norm(max(p - q, 0)) after a rejection."""
    return r


def unchecked_rho(p: torch.Tensor, qs: list[torch.Tensor]) -> float:
    """WRONG k-sequential search: rho = 1 whatever c is (SpecTr's c <= rho, i.e. S <= p, unchecked)."""
    return 1.0


def speculative_acceptance_with_k_sequential_residual(p: torch.Tensor, qs: list[torch.Tensor]) -> NodePlan:
    """WRONG plan: accepts with min(1, p / q), as plain speculative sampling does, but falls back
    to the k-sequential residual (which assumes acceptance min(1, p / (rho q)))."""
    plan = k_sequential_plan(p, qs)
    accept = [torch.where(q > 0, torch.clamp(p.double() / q.double(), max=1.0), 0.0) for q in qs]
    return NodePlan(accept, plan.residual, 0.0, "wrong")


def grouped_by_token(draws: tuple[int, ...]) -> list[int]:
    """WRONG order: the proposals grouped by the token (child) they drew, children in order of
    appearance; what ordering by SSM alone does to several draws of one SSM."""
    return sorted(range(len(draws)), key=lambda i: draws.index(draws[i]))


# 1. Exact algebra ------------------------------------------------------------------------------------
def exact_mss(p: torch.Tensor, qs: list[torch.Tensor]) -> torch.Tensor:
    """P(emit x) at one node whose proposals are x_i ~ qs[i] independently, verified by MSS in order."""
    if not qs:
        return p
    q = qs[0]
    accept = torch.where(q > 0, torch.clamp(p / q.clamp(min=1e-300), max=1.0), torch.zeros_like(p))
    rejected = 1.0 - (q * accept).sum()
    return q * accept + rejected * exact_mss(verify.residual(p, q), qs[1:])


def exact_without_replacement(p: torch.Tensor, d: torch.Tensor, k: int) -> torch.Tensor:
    """P(emit x) at one node with k children drawn from d without replacement (Sequoia Alg. 1)."""
    if k == 0:
        return p
    out = torch.zeros_like(p)
    for x in range(len(d)):
        if d[x] <= 0:
            continue
        accept = min(1.0, float(p[x] / d[x]))
        out[x] += d[x] * accept
        d_next = d.clone()
        d_next[x] = 0
        d_next = d_next / d_next.sum()
        out += d[x] * (1 - accept) * exact_without_replacement(verify.residual(p, d), d_next, k - 1)
    return out


def random_dist(seed: int, vocab: int = 5, scale: float = 1.5, zeros: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g, dtype=torch.float64) * scale
    if zeros:
        logits[torch.randperm(vocab, generator=g)[:zeros]] = -float("inf")
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("seed", range(6))
def test_exact_mss_is_lossless(seed: int) -> None:
    p = random_dist(seed, zeros=seed % 2)
    qs = [random_dist(100 + seed + i, scale=0.5 + i, zeros=i % 2) for i in range(3)]
    for k in (1, 2, 3):
        assert torch.allclose(exact_mss(p, qs[:k]), p, atol=1e-12)
    # k=1: the acceptance probability is sum min(p, q) = 1 - TV(p, q)
    q = qs[0]
    accept = float((q * torch.clamp(p / q.clamp(min=1e-300), max=1.0)).sum())
    assert accept == pytest.approx(1 - 0.5 * (p - q).abs().sum().item(), abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_exact_without_replacement_is_lossless(seed: int) -> None:
    p = random_dist(seed, zeros=seed % 2)
    q = random_dist(200 + seed, scale=2.0, zeros=(seed + 1) % 2)
    support = int((q > 0).sum())
    for k in range(1, support + 1):
        assert torch.allclose(exact_without_replacement(p, q, k), p, atol=1e-12)


def test_exact_wrong_residual_is_not_lossless() -> None:
    p, q = random_dist(0), random_dist(100, scale=0.5)
    broken = q * torch.clamp(p / q, max=1.0) + (1 - torch.minimum(p, q).sum()) * p
    assert not torch.allclose(broken, p, atol=1e-3)


# k-sequential selection (decoder/multi_draft.py): every draw of the k proposals enumerated.
def exact_plan(
    p: torch.Tensor,
    qs: list[torch.Tensor],
    plan: NodePlan,
    order: Callable[[tuple[int, ...]], list[int]] | None = None,
) -> tuple[torch.Tensor, float]:
    """P(emit x) at one node and P(some proposal is accepted), over every draw (x_1..x_k) with
    x_i ~ qs[i] independently: the proposal at position t is accepted with probability
    plan.accept[t] of its token; the fallback is plan.residual. `order(draws)`: the proposal at
    each position (default: drawing order)."""
    out, accepted = torch.zeros_like(p), 0.0
    for draws in itertools.product(range(len(p)), repeat=len(qs)):
        weight = math.prod(float(q[x]) for q, x in zip(qs, draws, strict=True))
        if weight == 0:
            continue
        reach = 1.0  # every earlier position rejected
        for position, i in enumerate(order(draws) if order else range(len(draws))):
            accept = float(plan.accept[position][draws[i]])
            out[draws[i]] += weight * reach * accept
            reach *= 1 - accept
        out += weight * reach * plan.residual
        accepted += weight * (1 - reach)
    return out, accepted


def k_draft_qs(seed: int, k: int, same: bool) -> list[torch.Tensor]:
    """k draft distributions (with zeros): one q drawn k times (SpecTr), or k different q's."""
    if same:
        return [random_dist(300 + seed, scale=2.0, zeros=(seed + 1) % 2)] * k
    return [random_dist(100 + seed + i, scale=0.5 + i, zeros=i % 2) for i in range(k)]


@pytest.mark.parametrize("same", [True, False], ids=["one_q", "different_qs"])
@pytest.mark.parametrize("seed", range(6))
def test_exact_k_sequential_is_lossless(seed: int, same: bool) -> None:
    """k = 1, 2, 3 proposals, p and q with zeros: the k-sequential rule, MSS as a rule of the same
    family, and the per-node choice between them emit p exactly, with the acceptance each plan
    states; the choice never accepts less than MSS; k = 1 is speculative sampling; with one q it
    is SpecTr's rule (S = c m, R = (p - c m) / (1 - beta)^k)."""
    p = random_dist(seed, zeros=seed % 2)
    for k in (1, 2, 3):
        qs = k_draft_qs(seed, k, same)
        mss, k_sequential, best = mss_plan(p, qs), k_sequential_plan(p, qs), best_plan(p, qs)
        for plan in (mss, k_sequential, best):
            out, accepted = exact_plan(p, qs, plan)
            torch.testing.assert_close(out, p, rtol=0, atol=1e-12)
            assert accepted == pytest.approx(plan.acceptance, abs=1e-12)
        assert best.acceptance == pytest.approx(max(mss.acceptance, k_sequential.acceptance), abs=1e-15)
        assert 1 <= k_sequential.rho <= k
        if k == 1:
            assert k_sequential.rho == 1
            assert k_sequential.acceptance == pytest.approx(1 - tv(p, qs[0]), abs=1e-12)
        if same:
            m = torch.minimum(qs[0], p / k_sequential.rho)
            beta = float(m.sum())
            c = (1 - (1 - beta) ** k) / beta
            spectr = torch.clamp(p - c * m, min=0) / (1 - beta) ** k
            torch.testing.assert_close(k_sequential.residual, spectr, rtol=0, atol=1e-12)
            assert k_sequential.acceptance == pytest.approx(1 - (1 - beta) ** k, abs=1e-12)


def test_exact_k_sequential_edge_cases() -> None:
    """Disjoint supports (beta = 0): nothing accepted, the fallback is p; q = p: always accepted,
    rho = 1; a one-hot p; no proposals at all (a leaf)."""
    p = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    disjoint = torch.tensor([0.0, 0.0, 0.25, 0.75], dtype=torch.float64)
    one_hot = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    for k in (1, 2, 3):
        plan = best_plan(p, [disjoint] * k)
        assert plan.acceptance == 0 and torch.equal(plan.residual, p)
        plan = k_sequential_plan(p, [p] * k)
        assert plan.rho == 1 and plan.acceptance == pytest.approx(1.0, abs=1e-15)
        qs = [random_dist(400 + i, vocab=4) for i in range(k)]
        for target in (p, one_hot):
            torch.testing.assert_close(
                exact_plan(target, qs, best_plan(target, qs))[0], target, rtol=0, atol=1e-12
            )
    leaf = best_plan(p, [])
    assert leaf.accept == [] and torch.equal(leaf.residual, p) and leaf.acceptance == 0


# An SSM sharper than the LLM (trained on greedy text, or the LLM sampled hotter): T = 0.5 on both.
SHARP_P = torch.softmax(torch.tensor([2.0, 1.5, 0.5, 0.0, -1.0], dtype=torch.float64) / 0.5, -1)
SHARP_Q = torch.softmax(torch.tensor([2.5, 1.0, 0.8, -0.5, -1.0], dtype=torch.float64) / 0.5, -1)


def test_exact_k_sequential_beats_mss_on_draws_of_one_sharper_q() -> None:
    """k draws of one q that over-weights the LLM's favourite: once MSS rejects the favourite, its
    residual is 0 there and every later draw of it (most of them) is rejected; the k-sequential
    rule keeps accepting it with probability p / (rho q). Exact acceptances (k = 1: equal)."""
    gains = []
    for k in (1, 2, 3, 4):
        qs = [SHARP_Q] * k
        k_sequential, mss = k_sequential_plan(SHARP_P, qs), mss_plan(SHARP_P, qs)
        gains.append(k_sequential.acceptance - mss.acceptance)
        print(f"k={k}: k_sequential {k_sequential.acceptance:.4f}, mss {mss.acceptance:.4f}")
        best = best_plan(SHARP_P, qs).acceptance
        assert best == pytest.approx(max(k_sequential.acceptance, mss.acceptance), abs=1e-15)
    assert gains[0] == pytest.approx(0, abs=1e-15)
    assert all(gain > 0.01 for gain in gains[1:]) and gains[1] < gains[2] < gains[3]


def test_exact_wrong_k_sequential_variants_are_not_lossless(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 draws of one q: without the feasibility check (rho = 1 with c > rho), with speculative
    sampling's acceptance and the k-sequential residual, or with the proposals grouped by the token
    they drew instead of drawing order, the output is not p."""
    qs = [Q] * 4
    ordered = k_sequential_plan(P, qs)
    assert tv(exact_plan(P, qs, ordered, order=grouped_by_token)[0], P) > 0.01
    assert tv(exact_plan(P, qs, speculative_acceptance_with_k_sequential_residual(P, qs))[0], P) > 0.1
    monkeypatch.setattr(multi_draft, "smallest_feasible_rho", unchecked_rho)
    assert tv(exact_plan(P, qs, k_sequential_plan(P, qs))[0], P) > 0.1


# 2. Rules on hand-built trees ----------------------------------------------------------------------
P = torch.tensor([0.35, 0.25, 0.2, 0.15, 0.05], dtype=torch.float64)
Q = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15], dtype=torch.float64)
Q2 = torch.tensor([0.3, 0.1, 0.3, 0.0, 0.3], dtype=torch.float64)
UNIT_DRAWS = 4000


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def one_node_outputs(
    rule: Callable[..., Verdict],
    p: torch.Tensor,
    draft: Callable[[torch.Generator], TokenTree],
    draws: int,
    seed: int,
) -> tuple[Counter, int]:
    """Run `rule` on `draws` freshly drafted one-level trees; count the emitted first token and
    how often a draft was accepted."""
    gen = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    accepted = 0
    for _ in range(draws):
        tree = draft(gen)
        rows = p.expand(len(tree), -1)
        verdict = rule(tree, rows, gen)
        token = tree.tokens[verdict.accepted[0]] if verdict.accepted else verdict.next_token
        counts[(token,)] += 1
        accepted += bool(verdict.accepted)
    return counts, accepted


def sampled_children(qs: list[torch.Tensor]) -> Callable[[torch.Generator], TokenTree]:
    """MSS drafting: proposal i is drawn from qs[i] (one per SSM); equal tokens merge into one node."""

    def draft(gen: torch.Generator) -> TokenTree:
        tree = TokenTree.root_only(0, DraftKind.SAMPLED)
        for ssm, q in enumerate(qs):
            tree.add_child(0, int(torch.multinomial(q, 1, generator=gen)), ssm, q)
        return tree

    return draft


def pool_draws(qs: list[torch.Tensor], samples: int) -> Callable[[torch.Generator], TokenTree]:
    """SSM i draws `samples` tokens independently from qs[i] (draw indices 0..samples-1), as
    `ChainShape(samples=k)` chains do at a node; equal tokens merge into one node."""

    def draft(gen: torch.Generator) -> TokenTree:
        tree = TokenTree.root_only(0, DraftKind.SAMPLED)
        for ssm, q in enumerate(qs):
            for j in range(samples):
                tree.add_child(0, int(torch.multinomial(q, 1, generator=gen)), ssm, q, draw=j)
        return tree

    return draft


def children_without_replacement(q: torch.Tensor, k: int) -> Callable[[torch.Generator], TokenTree]:
    def draft(gen: torch.Generator) -> TokenTree:
        tree = TokenTree.root_only(0, DraftKind.SAMPLED_WITHOUT_REPLACEMENT)
        for token in torch.multinomial(q, k, replacement=False, generator=gen).tolist():
            tree.add_child(0, token, 0, q)
        return tree

    return draft


@pytest.mark.parametrize(
    ("name", "qs"),
    [("one proposal", [Q]), ("two SSMs", [Q, Q2]), ("same q twice", [Q, Q]), ("three", [Q2, Q, Q2])],
    ids=["one", "two_ssms", "same_q_twice", "three"],
)
def test_mss_one_step_emits_p(name: str, qs: list[torch.Tensor]) -> None:
    counts, accepted = one_node_outputs(verify_mss, P, sampled_children(qs), UNIT_DRAWS, seed=1)
    pvalue = gof_pvalue(counts, P)
    assert pvalue >= ALPHA, f"MSS ({name}) does not emit p: p-value {pvalue:.2e}, counts {counts}"
    if len(qs) == 1:  # optimal transport: acceptance rate = 1 - TV(p, q)
        rate = 1 - tv(P, Q)
        binom = stats.binomtest(accepted, UNIT_DRAWS, rate).pvalue
        assert binom >= ALPHA, f"acceptance {accepted / UNIT_DRAWS:.4f}, expected {rate:.4f}"


@pytest.mark.parametrize("k", [1, 2, 3])
def test_without_replacement_one_step_emits_p(k: int) -> None:
    counts, accepted = one_node_outputs(
        verify_without_replacement, P, children_without_replacement(Q, k), UNIT_DRAWS, seed=2
    )
    pvalue = gof_pvalue(counts, P)
    assert pvalue >= ALPHA, f"without replacement (k={k}) does not emit p: p-value {pvalue:.2e}"
    if k == 1:
        binom = stats.binomtest(accepted, UNIT_DRAWS, 1 - tv(P, Q)).pvalue
        assert binom >= ALPHA, f"k=1 acceptance {accepted / UNIT_DRAWS:.4f} != 1 - TV = {1 - tv(P, Q):.4f}"


def test_without_replacement_cover_property() -> None:
    """Children covering the support of q (which contains p's support) are always accepted, even
    at a low temperature where p and q disagree; MSS with as many i.i.d. proposals is not."""
    p = torch.softmax(torch.tensor([4.0, 0.0, 1.0, -1.0, -float("inf")], dtype=torch.float64) / 0.3, -1)
    q = torch.softmax(torch.tensor([0.0, 3.0, 1.0, 0.5, -float("inf")], dtype=torch.float64) / 0.3, -1)
    support = int((q > 0).sum())
    _, accepted = one_node_outputs(
        verify_without_replacement, p, children_without_replacement(q, support), 1000, seed=3
    )
    assert accepted == 1000
    _, accepted_mss = one_node_outputs(verify_mss, p, sampled_children([q] * support), 1000, seed=3)
    assert accepted_mss < 1000


def test_target_one_step_emits_p() -> None:
    """Target sampling on a top-k tree (children that were NOT sampled from any q)."""

    def top_k_tree(gen: torch.Generator) -> TokenTree:
        tree = TokenTree.root_only(0, DraftKind.TOP_K)
        for token in torch.topk(Q, 2).indices.tolist():
            tree.add_child(0, token, 0)
        return tree

    counts, accepted = one_node_outputs(verify_target, P, top_k_tree, UNIT_DRAWS, seed=4)
    assert gof_pvalue(counts, P) >= ALPHA
    accept_rate = float(P[torch.topk(Q, 2).indices].sum())  # y ~ p lands on a child
    assert stats.binomtest(accepted, UNIT_DRAWS, accept_rate).pvalue >= ALPHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_drafts_are_drawn_from_q(dtype: torch.dtype) -> None:
    """`sampling.draw`, the SSMs' draws (inverse CDF, not `torch.multinomial`), follows q, rows of
    a batch each their own, never a token of probability 0 (the first and last tokens among them),
    the same draws for the same generator seed; the harness rejects a draw off by one token."""
    q = random_dist(7, vocab=9, zeros=3).to(dtype)
    q[0] = q[-1] = 0
    q /= q.sum()
    rows = torch.stack([q, q.flip(0)])
    drawn = sampling.draw(rows, UNIT_DRAWS, torch.Generator().manual_seed(0))  # [2, UNIT_DRAWS]
    assert drawn.shape == (2, UNIT_DRAWS)
    for row, expected in zip(drawn, rows, strict=True):
        counts = Counter((int(token),) for token in row)
        assert gof_pvalue(counts, expected) >= ALPHA
        assert gof_pvalue(Counter({((t + 1) % 9,): c for (t,), c in counts.items()}), expected) < 1e-6
    again = sampling.draw(rows, UNIT_DRAWS, torch.Generator().manual_seed(0))
    assert torch.equal(drawn, again)
    assert sampling.draw(q, 3).shape == (3,)


@pytest.mark.parametrize(
    ("wrong", "draft"),
    [
        ("accept_every_draft", sampled_children([Q])),
        ("mss_without_residual", sampled_children([Q])),
        ("mss_without_residual", sampled_children([Q, Q2])),
        ("without_replacement_without_residual", children_without_replacement(Q, 2)),
    ],
)
def test_wrong_rules_fail_one_step(wrong: str, draft, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness has the power to reject broken rules (p-value < WRONG_P)."""
    rule = {
        "accept_every_draft": accept_every_draft,
        "mss_without_residual": verify_mss,
        "without_replacement_without_residual": verify_without_replacement,
    }[wrong]
    if wrong != "accept_every_draft":
        monkeypatch.setattr(verify, "residual", _no_residual)
    counts, _ = one_node_outputs(rule, P, draft, UNIT_DRAWS, seed=5)
    pvalue = gof_pvalue(counts, P)
    assert pvalue < WRONG_P, f"the harness failed to reject {wrong}: p-value {pvalue:.2e}"


K_SEQUENTIAL_DRAFTS = {  # name -> (one q per SSM, draws per SSM)
    "one_draft": ([Q], 1),
    "one_q_twice": ([Q], 2),
    "one_q_4_times": ([Q], 4),
    "two_ssms": ([Q, Q2], 1),
    "two_ssms_twice": ([Q, Q2], 2),
}


@pytest.mark.parametrize("case", sorted(K_SEQUENTIAL_DRAFTS))
def test_k_sequential_one_step_emits_p(case: str) -> None:
    """1, 2 and 4 drafts, of one SSM or two: the output is p and the acceptance the exact one."""
    qs, samples = K_SEQUENTIAL_DRAFTS[case]
    counts, accepted = one_node_outputs(verify_k_sequential, P, pool_draws(qs, samples), UNIT_DRAWS, seed=11)
    pvalue = gof_pvalue(counts, P)
    assert pvalue >= ALPHA, f"k_sequential ({case}) does not emit p: p-value {pvalue:.2e}, counts {counts}"
    rate = best_plan(P, [q for q in qs for _ in range(samples)]).acceptance  # in drawing order
    binom = stats.binomtest(accepted, UNIT_DRAWS, rate).pvalue
    assert binom >= ALPHA, f"acceptance {accepted / UNIT_DRAWS:.4f}, exact {rate:.4f}"


@pytest.mark.parametrize("wrong", ["unchecked_rho", "speculative_acceptance"])
def test_wrong_k_sequential_variants_fail_one_step(wrong: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness rejects the k-sequential rule without its feasibility check, and with plain
    speculative sampling's acceptance in front of the k-sequential residual."""
    if wrong == "unchecked_rho":
        monkeypatch.setattr(multi_draft, "smallest_feasible_rho", unchecked_rho)
    else:
        monkeypatch.setattr(verify, "best_plan", speculative_acceptance_with_k_sequential_residual)
    counts, _ = one_node_outputs(verify_k_sequential, P, pool_draws([Q], 4), UNIT_DRAWS, seed=12)
    pvalue = gof_pvalue(counts, P)
    assert pvalue < WRONG_P, f"the harness failed to reject {wrong}: p-value {pvalue:.2e}"


def test_k_sequential_accepts_more_than_mss_on_the_same_trees() -> None:
    """Measured: the same 2000 one-level trees of 4 draws of SHARP_Q, verified by both rules. The
    k-sequential rule accepts at least as often as MSS (here more: exact 0.8412 against 0.8098),
    and each rule's acceptance matches its exact value."""
    gen = torch.Generator().manual_seed(13)
    trees = [pool_draws([SHARP_Q], 4)(gen) for _ in range(2000)]
    rates = {}
    for rule in (verify_mss, verify_k_sequential):
        gen = torch.Generator().manual_seed(14)
        verdicts = [rule(tree, SHARP_P.expand(len(tree), -1), gen) for tree in trees]
        rates[rule.__name__] = sum(bool(v.accepted) for v in verdicts) / len(trees)
    exact = {"verify_mss": mss_plan, "verify_k_sequential": k_sequential_plan}
    print(f"measured acceptance on the same trees: {rates}")
    for name, rate in rates.items():
        expected = exact[name](SHARP_P, [SHARP_Q] * 4).acceptance
        assert stats.binomtest(round(rate * len(trees)), len(trees), expected).pvalue >= ALPHA
    assert rates["verify_k_sequential"] >= rates["verify_mss"]


# Two levels: p and q depend on the context; the rule walks down the tree.
def conditional_tables(seed: int, vocab: int = 5, scale: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    """[V] first-token and [V, V] second-token distributions."""
    first = random_dist(seed, vocab, scale)
    second = torch.stack([random_dist(seed * 100 + t + 1, vocab, scale) for t in range(vocab)])
    return first, second


def two_level_joint_counts(
    rule: Callable[..., Verdict],
    draft: Callable[[torch.Generator], TokenTree],
    p1: torch.Tensor,
    p2: torch.Tensor,
    draws: int,
    seed: int,
) -> Counter:
    """Counts of the first two emitted tokens. The rule sees row p1 at the root, p2[t1] at the
    node of token t1 and (unused here) p1 deeper; a step that emits only one token is completed by
    sampling t2 ~ p2[t1] as the LLM's next step would."""
    gen = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    for _ in range(draws):
        tree = draft(gen)
        rows = torch.stack([p1 if tree.depths[u] != 1 else p2[tree.tokens[u]] for u in range(len(tree))])
        verdict = rule(tree, rows, gen)
        emitted = [tree.tokens[u] for u in verdict.accepted] + [verdict.next_token]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(p2[emitted[0]], 1, generator=gen)))
        counts[tuple(emitted[:2])] += 1
    return counts


def two_level_draft(
    kind: DraftKind, q1s: list[torch.Tensor], q2s: list[torch.Tensor], width: int = 1, samples: int = 1
) -> Callable[[torch.Generator], TokenTree]:
    """SAMPLED: `samples` chains of 2 per SSM (x1 ~ q1s[i], x2 ~ q2s[i][x1]), merged.
    SAMPLED_WITHOUT_REPLACEMENT: `width` children w/o replacement, each with `width` children.
    TOP_K: the top-`width` tokens of q at every node."""

    def draft(gen: torch.Generator) -> TokenTree:
        tree = TokenTree.root_only(0, kind)
        if kind is DraftKind.SAMPLED:
            for ssm, (q1, q2) in enumerate(zip(q1s, q2s, strict=True)):
                for j in range(samples):
                    x1 = int(torch.multinomial(q1, 1, generator=gen))
                    node = tree.add_child(0, x1, ssm, q1, draw=j)
                    x2 = int(torch.multinomial(q2[x1], 1, generator=gen))
                    tree.add_child(node, x2, ssm, q2[x1], draw=j)
            return tree
        q1, q2 = q1s[0], q2s[0]
        if kind is DraftKind.SAMPLED_WITHOUT_REPLACEMENT:
            pick = lambda q: torch.multinomial(q, width, replacement=False, generator=gen).tolist()  # noqa: E731
        else:
            pick = lambda q: torch.topk(q, width).indices.tolist()  # noqa: E731
        for x1 in pick(q1):
            node = tree.add_child(0, x1, 0, q1)
            for x2 in pick(q2[x1]):
                tree.add_child(node, x2, 0, q2[x1])
        return tree

    return draft


@pytest.mark.parametrize(
    ("rule", "kind", "ssms", "width"),
    [
        (verify_mss, DraftKind.SAMPLED, 1, 1),
        (verify_mss, DraftKind.SAMPLED, 2, 1),
        (verify_without_replacement, DraftKind.SAMPLED_WITHOUT_REPLACEMENT, 1, 2),
        (verify_target, DraftKind.TOP_K, 1, 2),
        (verify_target, DraftKind.SAMPLED, 2, 1),
    ],
)
def test_rules_two_levels_emit_joint_p(rule, kind: DraftKind, ssms: int, width: int) -> None:
    p1, p2 = conditional_tables(7)
    tables = [conditional_tables(8 + i, scale=1.0 + i) for i in range(ssms)]
    draft = two_level_draft(kind, [t[0] for t in tables], [t[1] for t in tables], width)
    counts = two_level_joint_counts(rule, draft, p1, p2, UNIT_DRAWS, seed=9)
    pvalue = gof_pvalue(counts, p1[:, None] * p2)
    assert pvalue >= ALPHA, f"{rule.__name__} on {kind.value} trees: p-value {pvalue:.2e}"


def test_wrong_rule_fails_two_levels() -> None:
    p1, p2 = conditional_tables(7)
    q1, q2 = conditional_tables(8)
    draft = two_level_draft(DraftKind.SAMPLED, [q1], [q2])
    counts = two_level_joint_counts(accept_every_draft, draft, p1, p2, UNIT_DRAWS, seed=9)
    assert gof_pvalue(counts, p1[:, None] * p2) < WRONG_P


@pytest.mark.parametrize(
    ("rule", "ssms", "samples"),
    [
        (verify_k_sequential, 1, 1),
        (verify_k_sequential, 1, 2),
        (verify_k_sequential, 1, 4),
        (verify_k_sequential, 2, 2),
        (verify_mss, 1, 4),
    ],
)
def test_sampled_chains_two_levels_emit_joint_p(rule, ssms: int, samples: int) -> None:
    """Chains of 2, `samples` per SSM (chains through a node draw their next tokens independently),
    merged: k_sequential with 1, 2 and 4 drafts (one SSM) and 4 (two SSMs x 2); MSS with several
    draws of one SSM, taken in drawing order."""
    p1, p2 = conditional_tables(7)
    tables = [conditional_tables(8 + i, scale=1.0 + i) for i in range(ssms)]
    draft = two_level_draft(
        DraftKind.SAMPLED, [t[0] for t in tables], [t[1] for t in tables], samples=samples
    )
    counts = two_level_joint_counts(rule, draft, p1, p2, UNIT_DRAWS, seed=15)
    pvalue = gof_pvalue(counts, p1[:, None] * p2)
    assert pvalue >= ALPHA, f"{rule.__name__}, {ssms} SSMs x {samples} chains: p-value {pvalue:.2e}"


# 3. End to end through SpeculativeDecoder.generate ---------------------------------------------------
def spread(model: torch.nn.Module, lm_head_scale: float = 5.0) -> torch.nn.Module:
    """Freshly initialised tiny models have almost uniform next-token distributions; scaling the
    weights makes them spread out (neither uniform nor one-hot) and context dependent."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and "embed" not in name:
                param.mul_(3.0)
        model.lm_head.weight.mul_(lm_head_scale)
    return model


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {
        "llm": spread(tiny_llama(layers=2, seed=1, vocab=VOCAB)),
        "ssm_a": spread(tiny_llama(layers=1, seed=2, vocab=VOCAB)),
        "ssm_b": spread(tiny_llama(layers=1, seed=3, vocab=VOCAB)),
    }


@torch.no_grad()
def exact_joint(llm: torch.nn.Module, prompt: list[int], config: SamplingConfig, length: int) -> torch.Tensor:
    """[V] * length: P(t1..tn) = prod_i p(t_i | prompt, t_<i), by enumerating every prefix with plain
    causal forward passes of the LLM (no cache, no tree attention) and the same logits warpers."""
    to_probs = LogitsToProbs(config)
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = [list(prompt)]
    for _ in range(length):
        step = to_probs(llm(torch.tensor(prefixes)).logits[:, -1].double())  # [prefixes, V]
        joint = (joint[:, None] * step).reshape(-1)
        prefixes = [[*prefix, t] for prefix in prefixes for t in range(VOCAB)]
    return joint.reshape([VOCAB] * length)


def seeded_generate(dec: SpeculativeDecoder, prompt: torch.Tensor, seed: int, seeded: bool, **options):
    """`dec.generate` with `seed=seed`, or (not `seeded`) unseeded after seeding torch's global stream."""
    if not seeded:
        torch.manual_seed(seed)
    return dec.generate(prompt, do_sample=True, seed=seed if seeded else None, eos_token_id=None, **options)


def sample_decoder(
    dec: SpeculativeDecoder, samples: int, max_new_tokens: int, seed0: int, seeded: bool = True, **sampling
) -> tuple[Counter, float]:
    """Counts of the generated token tuples over `samples` seeds (`seeded=False`: seeds of torch's
    global stream, the requests unseeded); and accepted drafts per call."""
    counts: Counter = Counter()
    accepted = 0
    prompt = torch.tensor([PROMPT])
    for seed in range(seed0, seed0 + samples):
        out = seeded_generate(dec, prompt, seed, seeded, max_new_tokens=max_new_tokens, **sampling)
        new = out.sequences[0, len(PROMPT) :].tolist()
        assert len(new) == max_new_tokens
        counts[tuple(new)] += 1
        accepted += out.stats.accepted_tokens
    print(f"accepted drafts per call: {accepted / samples:.3f}")
    return counts, accepted / samples


def sample_batches(
    dec: SpeculativeDecoder,
    batch: int,
    max_new_tokens: int,
    seed0: int,
    seeded: bool = True,
    drafts: bool = True,
    **sampling,
) -> Counter:
    """Counts of the generated token tuples of E2E_SAMPLES rows: batches of `batch` rows of the
    prompt, one seed per batch (each row gets its own stream; `seeded=False`: unseeded rows after
    seeding torch's global stream); checks that drafts were accepted (unless `drafts` is False: a
    decoder that drafts nothing)."""
    counts: Counter = Counter()
    accepted = 0
    for seed in range(seed0, seed0 + E2E_SAMPLES // batch):
        prompt = torch.tensor([PROMPT] * batch)
        out = seeded_generate(dec, prompt, seed, seeded, max_new_tokens=max_new_tokens, **sampling)
        for row in out.sequences[:, len(PROMPT) :].tolist():
            counts[tuple(row)] += 1
        accepted += sum(s.accepted_tokens for s in out.stats.sequences)
    assert accepted > 0 or not drafts, "no draft was accepted"
    return counts


def assert_lossless(counts: Counter, exact: torch.Tensor, label: str) -> dict[int, float]:
    """Chi-square on the joint of every prefix length >= 2 (pairs, then triples)."""
    pvalues = {}
    for length in range(2, exact.dim() + 1):
        prefix_exact = exact.sum(dim=tuple(range(length, exact.dim()))) if length < exact.dim() else exact
        pvalues[length] = gof_pvalue(marginal(counts, length), prefix_exact)
    assert min(pvalues.values()) >= ALPHA, f"{label}: output differs from the LLM's, p-values {pvalues}"
    return pvalues


E2E_SAMPLES = 600


def check_decoder(
    dec: SpeculativeDecoder,
    max_new_tokens: int,
    seed0: int,
    min_accepted: float,
    seeded: bool = True,
    **sampling,
) -> dict[int, float]:
    """Sample `dec` E2E_SAMPLES times and compare with the LLM's exact joint distribution; also check
    that speculation was not trivial (drafts really were accepted)."""
    counts, accepted = sample_decoder(dec, E2E_SAMPLES, max_new_tokens, seed0, seeded, **sampling)
    exact = exact_joint(dec.llm, PROMPT, SamplingConfig(do_sample=True, **sampling), max_new_tokens)
    pvalues = assert_lossless(counts, exact, f"{sampling}")
    assert accepted > min_accepted, f"only {accepted:.3f} drafts accepted per call"
    return pvalues


def test_mss_chain_one_ssm(models) -> None:
    """Classic speculative sampling: one SSM drafts a sampled chain; T=0.7, top_k=4.
    (max_new_tokens=2: the first step drafts one token, a rejection needs a second step.)"""
    dec = SpeculativeDecoder(models["llm"], [models["ssm_a"]], shape=ChainShape(4))
    check_decoder(dec, 2, seed0=10_000, min_accepted=0.15, temperature=0.7, top_k=4)


def test_mss_chain_two_ssms_merged(models, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two SSMs draft sampled chains of 2, merged into one tree and verified by multi-step
    speculative sampling; T=1.3, top_p=0.9. Checks that the proposals really were merged."""
    seen = {"root_proposals": 0, "shared_nodes": 0, "shared_deep": 0}

    def spy(tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
        seen["root_proposals"] = max(
            seen["root_proposals"], sum(len(tree.proposals[c]) for c in tree.children[0])
        )
        for u, props in enumerate(tree.proposals):
            if len({prop.ssm for prop in props}) > 1:  # one node, proposals from both SSMs
                seen["shared_nodes"] += 1
                seen["shared_deep"] += tree.depths[u] > 1
        return verify_mss(tree, p, generator)

    monkeypatch.setitem(verify.RULES, Rule.MSS, spy)
    dec = SpeculativeDecoder(models["llm"], [models["ssm_a"], models["ssm_b"]], shape=ChainShape(2))
    check_decoder(dec, 3, seed0=20_000, min_accepted=0.5, temperature=1.3, top_p=0.9)
    assert seen["root_proposals"] == 2  # both SSMs proposed at the root
    assert seen["shared_nodes"] > 0 and seen["shared_deep"] > 0  # merged, also below depth 1


def test_without_replacement_topology(models) -> None:
    """Sequoia: one SSM fills a fixed tree (root with 3 children, 2 + 1 grandchildren) by sampling
    without replacement; rule='without_replacement'; T=0.7, top_p=0.9."""
    shape = TopologyShape.from_children_counts([[3], [2, 1, 0]])
    dec = SpeculativeDecoder(models["llm"], [models["ssm_a"]], shape=shape, rule="without_replacement")
    check_decoder(dec, 3, seed0=30_000, min_accepted=0.5, temperature=0.7, top_p=0.9)


def test_target_beam(models) -> None:
    """Target sampling verifies a (deterministic) beam-search tree of width 2, depth 2; T=1.3, top_k=4."""
    dec = SpeculativeDecoder(
        models["llm"], [models["ssm_b"]], shape=BeamShape(width=2, depth=2), rule="target"
    )
    check_decoder(dec, 3, seed0=40_000, min_accepted=0.15, temperature=1.3, top_k=4)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("batch", [1, 4])
def test_routed_chains(models, batch: int, seeded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The routed scheduler (ALGORITHMS.md section 5.3): per step plain or one SSM's chain, the SSM
    and length from a predictor that favours drafting; alone and in a batch of 4 rows of the prompt
    routed together. Seeded requests: chains coupled to the target rule's draws, verified by it;
    unseeded: sampled chains verified by MSS (checked with a spy on the rules). T=1.3, top_k=4."""
    used: Counter = Counter()
    for rule in (Rule.MSS, Rule.TARGET):
        monkeypatch.setitem(verify.RULES, rule, counted(verify.RULES[rule], used, rule))
    predictor = constant_predictor([[[0.9, 1.8], [1.0, 2.0]]] * 2)
    dec = SpeculativeDecoder(
        models["llm"],
        [models["ssm_a"], models["ssm_b"]],
        strategy="learned",
        predictor=predictor,
        cost_model=cost_table(2, VERIFY, SPECULATE),
        strategy_options=StrategyOptions(gate=False),  # keep drafting, whatever plain decoding measures
    )
    for router in map(dec.speculator.router_for, (SAMPLED, SEEDED)):  # each learns apart
        router.calibration = router.costs = None  # a made-up profile: keep drafting on its numbers
    sampling = dict(temperature=1.3, top_k=4)
    if batch == 1:
        check_decoder(dec, 3, seed0=45_000, min_accepted=0.15, seeded=seeded, **sampling)
    else:
        counts = sample_batches(dec, batch, 3, 46_000, seeded, **sampling)
        assert_lossless(
            counts,
            exact_joint(models["llm"], PROMPT, SamplingConfig(do_sample=True, **sampling), 3),
            "routed batch",
        )
    assert set(used) == {Rule.TARGET if seeded else Rule.MSS}


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_plain_strategy(models, seeded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculation off (strategy="plain"): each step draws from p. Seeded requests draw under the
    target rule (`torch.multinomial`, as `generate` does: the same text under the same seed),
    unseeded ones under MSS, whose draw on a tree without children is `sampling.draw`'s (cheaper:
    our plain loop's sampled step had cost about 0.15 ms more than the routed decoder's plain step).
    Checked with a spy on the rules; T=1.3, top_k=4, 3 tokens, batch 1 and a batch of 4."""
    used: Counter = Counter()
    for rule in (Rule.MSS, Rule.TARGET):
        monkeypatch.setitem(verify.RULES, rule, counted(verify.RULES[rule], used, rule))
    dec = SpeculativeDecoder(models["llm"], [], strategy="plain")
    sampling = dict(temperature=1.3, top_k=4)
    exact = exact_joint(models["llm"], PROMPT, SamplingConfig(do_sample=True, **sampling), 3)
    counts, _ = sample_decoder(dec, E2E_SAMPLES, 3, 47_000, seeded, **sampling)
    assert_lossless(counts, exact, "plain")
    counts = sample_batches(dec, 4, 3, 48_000, seeded, drafts=False, **sampling)
    assert_lossless(counts, exact, "plain batch")
    assert set(used) == {Rule.TARGET if seeded else Rule.MSS}


def counted(rule: Callable, used: Counter, name: Rule) -> Callable:
    """`rule`, counting its calls in `used[name]`."""

    def spy(tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
        used[name] += 1
        return rule(tree, p, generator)

    return spy


def test_target_topology(models) -> None:
    """Target sampling on a Sequoia topology (3 children at the root); T=0.7, top_p=0.9, top_k=5."""
    shape = TopologyShape.from_children_counts([[3], [2, 1, 0]])
    dec = SpeculativeDecoder(models["llm"], [models["ssm_a"]], shape=shape, rule="target")
    check_decoder(dec, 2, seed0=50_000, min_accepted=0.15, temperature=0.7, top_p=0.9, top_k=5)


@pytest.mark.parametrize("wrong", ["accept_every_draft", "mss_without_residual"])
def test_wrong_rule_fails_end_to_end(models, wrong: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same harness rejects a broken verification rule patched into the decoder."""
    if wrong == "accept_every_draft":
        monkeypatch.setitem(verify.RULES, Rule.MSS, accept_every_draft)
    else:
        monkeypatch.setattr(verify, "residual", _no_residual)
    sampling = dict(temperature=1.0)
    dec = SpeculativeDecoder(models["llm"], [models["ssm_a"]], shape=ChainShape(1))
    counts, _ = sample_decoder(dec, 400, 2, seed0=60_000, **sampling)
    exact = exact_joint(models["llm"], PROMPT, SamplingConfig(do_sample=True, **sampling), 2)
    pvalue = gof_pvalue(counts, exact)
    assert pvalue < WRONG_P, f"{wrong} was not detected: p-value {pvalue:.2e}"


# name -> (SSMs, shape, sampling options): two temperatures, top-k and top-p each at least once
K_SEQUENTIAL_E2E = {
    "one_ssm_1_chain": (["ssm_a"], ChainShape(3), dict(temperature=0.7, top_k=4)),
    "one_ssm_2_chains": (["ssm_a"], ChainShape(2, samples=2), dict(temperature=1.3, top_p=0.9)),
    "one_ssm_4_chains": (["ssm_b"], ChainShape(2, samples=4), dict(temperature=0.7, top_p=0.9)),
    "two_ssms": (["ssm_a", "ssm_b"], ChainShape(2), dict(temperature=1.3, top_k=4)),
    "two_ssms_2_chains": (["ssm_a", "ssm_b"], ChainShape(2, samples=2), dict(temperature=0.7)),
}


@pytest.mark.parametrize("case", list(K_SEQUENTIAL_E2E))
def test_k_sequential_end_to_end(models, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """rule='k_sequential' on one SSM drawing 1, 2 and 4 sampled chains and on two SSMs (1 or 2
    chains each), merged: the output has the LLM's joint distribution. Checks that every chain
    reached the root (SSMs x samples proposals there) and that nodes with several proposals were
    verified (the rule's choice between k-sequential and MSS is recorded)."""
    names, shape, sampling = K_SEQUENTIAL_E2E[case]
    seen: Counter = Counter()

    def spy(p: torch.Tensor, qs: list[torch.Tensor]) -> NodePlan:
        plan = best_plan(p, qs)
        seen["root_proposals"] = max(seen["root_proposals"], len(qs))
        seen[plan.rule] += len(qs) > 1
        return plan

    monkeypatch.setattr(verify, "best_plan", spy)
    dec = SpeculativeDecoder(models["llm"], [models[n] for n in names], shape=shape, rule="k_sequential")
    seed0 = 70_000 + 1000 * list(K_SEQUENTIAL_E2E).index(case)
    check_decoder(dec, 3, seed0=seed0, min_accepted=0.3, **sampling)
    print(f"nodes with several proposals verified by: {dict(seen)}")
    assert seen["root_proposals"] == len(names) * shape.samples
    if seen["root_proposals"] > 1:
        assert seen["k_sequential"] + seen["mss"] > 0


def test_k_sequential_batched(models) -> None:
    """A batch (4 rows of the prompt, each with its own seed): several chains per SSM are drafted
    per sequence by the tree plans, at the batch's (BASS) chain lengths; still lossless."""
    dec = SpeculativeDecoder(
        models["llm"], [models["ssm_a"]], shape=ChainShape(2, samples=2), rule="k_sequential"
    )
    sampling = dict(temperature=1.0, top_k=5)
    counts = sample_batches(dec, 4, 2, 80_000, **sampling)
    exact = exact_joint(models["llm"], PROMPT, SamplingConfig(do_sample=True, **sampling), 2)
    assert_lossless(counts, exact, "batched k_sequential")


def test_k_sequential_end_to_end_accepts_at_least_as_much_as_mss(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured through the decoder: one SSM drawing 4 chains of 2, T=1.3. At every node of the
    real trees with several proposals, the exact acceptance of the rule k_sequential used is at
    least MSS's for the same proposals, and more in total. Both rules, run with the same seeds,
    are lossless (MSS on several draws of one SSM too, taken in drawing order); their realised
    acceptances are printed, not compared (600 calls cannot resolve a gain of this size)."""
    exact: dict[str, list[float]] = {"k_sequential": [], "mss": []}

    def spy(p: torch.Tensor, qs: list[torch.Tensor]) -> NodePlan:
        plan = best_plan(p, qs)
        if len(qs) > 1:
            exact["k_sequential"].append(plan.acceptance)
            exact["mss"].append(mss_plan(p, qs).acceptance)
        return plan

    monkeypatch.setattr(verify, "best_plan", spy)
    sampling = dict(temperature=1.3)
    joint = exact_joint(models["llm"], PROMPT, SamplingConfig(do_sample=True, **sampling), 3)
    realised = {}
    for rule in ("mss", "k_sequential"):
        dec = SpeculativeDecoder(models["llm"], [models["ssm_a"]], shape=ChainShape(2, samples=4), rule=rule)
        counts, realised[rule] = sample_decoder(dec, E2E_SAMPLES, 3, seed0=90_000, **sampling)
        assert_lossless(counts, joint, rule)
    nodes = len(exact["mss"])
    mean = {rule: sum(values) / nodes for rule, values in exact.items()}
    print(f"exact acceptance per node with several proposals ({nodes} nodes): {mean}")
    print(f"realised accepted drafts per call (3 new tokens): {realised}")
    assert all(k >= m for k, m in zip(exact["k_sequential"], exact["mss"], strict=True))
    assert mean["k_sequential"] > mean["mss"]


@pytest.mark.parametrize("wrong", ["unchecked_rho", "speculative_acceptance"])
def test_wrong_k_sequential_fails_end_to_end(models, wrong: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The end-to-end harness rejects the two broken k-sequential variants."""
    if wrong == "unchecked_rho":
        monkeypatch.setattr(multi_draft, "smallest_feasible_rho", unchecked_rho)
    else:
        monkeypatch.setattr(verify, "best_plan", speculative_acceptance_with_k_sequential_residual)
    sampling = dict(temperature=1.0)
    dec = SpeculativeDecoder(
        models["llm"], [models["ssm_a"]], shape=ChainShape(1, samples=4), rule="k_sequential"
    )
    counts, _ = sample_decoder(dec, 400, 2, seed0=95_000, **sampling)
    exact = exact_joint(models["llm"], PROMPT, SamplingConfig(do_sample=True, **sampling), 2)
    pvalue = gof_pvalue(counts, exact)
    assert pvalue < WRONG_P, f"{wrong} was not detected: p-value {pvalue:.2e}"


def test_exact_joint_is_a_distribution(models) -> None:
    """Sanity of the reference: it sums to 1, is spread out, and depends on the context."""
    config = SamplingConfig(do_sample=True, temperature=1.0)
    joint = exact_joint(models["llm"], PROMPT, config, 2)
    assert float(joint.sum()) == pytest.approx(1.0, abs=1e-6)  # float32 processing, as generate
    assert 0.05 < float(joint.max()) < 0.5
    second = joint / joint.sum(-1, keepdim=True)
    assert max(tv(second[0], second[t]) for t in range(1, VOCAB)) > 0.1
    for ssm in ("ssm_a", "ssm_b"):
        q = exact_joint(models[ssm], PROMPT, config, 2)
        assert tv(q.flatten(), joint.flatten()) > 0.2  # q != p: drafts are not trivially right


def test_cells_merge() -> None:
    """The harness itself: exact counts give p-value 1; an impossible observation gives 0."""
    probs = torch.tensor([[0.5, 0.25], [0.2, 0.05]], dtype=torch.float64)
    counts = Counter({(0, 0): 500, (0, 1): 250, (1, 0): 200, (1, 1): 50})
    assert gof_pvalue(counts, probs) == pytest.approx(1.0)
    assert gof_pvalue(counts + Counter({(1, 1): 1}), torch.tensor([[0.5, 0.3], [0.2, 0.0]])) == 0.0
    assert marginal(counts, 1) == Counter({(0,): 750, (1,): 250})
