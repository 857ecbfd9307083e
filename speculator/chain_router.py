"""The routed scheduler's rule (ALGORITHMS.md section 5.3): per step and per batch, plain decoding
or one SSM's argmax chain per row, the SSM and the length chosen from the LLM's hidden states.

Actions. Per row, no draft, or SSM i's argmax chain of d tokens, d from the predictor's grid
depths. So every fixed single-SSM chain of a grid length, and plain decoding, is an action; a
merged tree of several SSMs is not (on the hardware we measured, one tiny SSM's step is bound by
per-call overhead, and drafting with several costs 2-3x one for +5% tokens per step).

Rule, for a batch of B rows with predicted matches f[b, i, d] (the predictor's width-1 output
through SSM i's online correction at depth d, the line b_id f + c_id of section 5.1, "Slopes",
clipped to [0, the row's tokens wanted]):
choose the length d and the set U of SSMs that draft this step; every row takes its best SSM of U,
e_b = max_{i in U} f[b, i, d]; the score is

    score(d, U) = T(e) / (v L_verify(B, 1 + d) + g sum_{i in U} L_chain(i, n_i, d)),
    T(e) = (B + sum_b e_b) / 2 + B (1 + max_b r_b - max_b (r_b - e_b)) / 2

with T the batch judged whole (ALGORITHMS.md 5.3, "A batch is judged whole"; `batch_tokens`): half
the mean row's gain and half the gain of the row with the most tokens left, which a static batch's
call waits for, as the speculation gate counts a step (5.4); r_b the tokens row b may still draft,
n_i the rows routed to SSM i, L_verify and L_chain the profile's chain tables at this batch
size (`CostModel.chain_verify_time`, `chain_draft_table`: its sampled chains' table when the rows
draft host trees, sampled or processed) and v, g the online cost corrections of
drafting steps (section 5.2); on the compiled loop an SSM with a row further behind than one
compiled catch-up pass takes also pays its eager pass's extra time, shared by the mean drafting
stretch (`Stretches`; ALGORITHMS.md 5.3, "Catching up"). "No draft" for the whole batch scores
B / (v_plain L_verify(B, 1)), plain steps' own correction: plain decoding, so the rule never
speculates where it expects to lose. Then K = 0 per row: a row whose draft is worth less than the
drafting time it adds (what T loses without it x seconds < T x its marginal L_chain) drafts
nothing, but for the most promising row (all rows off is the plain step, already scored above).
The verify pass pads every row to the longest chain, so a row's own length only changes the
drafting. All (d, U) pairs are scored at once: at most `max_subsets` sets U (every subset of a
small pool; else each SSM alone and the whole pool). At batch 1 this is the argmax over (SSM i,
length d) and "plain" of (1 + f_i(d)) / (L_verify(1 + d) + L_chain(i, 1, d)).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from specboost.speculator.cost_model import CostModel
from specboost.speculator.kv_cache import COMPILED_MAX_CHAIN, setup_count
from specboost.speculator.predictor import MatchLengthPredictor, PassHead, apply_head
from specboost.speculator.scheduler import COST_RANGE, IDLE_DECAY, CostCorrection, Draft, OnlineCalibration

NO_SSM = -1
MAX_SKIP = 8  # plain steps taken without deciding, at most, after consecutive plain decisions
MAX_HOLD = 4  # steps drafting a held action without deciding, at most, after it was chosen again
PREFERENCE_MOMENTUM = 0.95  # per drafting step, of the older steps' weight in the preferred action
ACCEPTANCE_MOMENTUM = 0.8  # per drafting step, of the older steps' evidence of a held SSM's acceptance
STRETCH_MOMENTUM = 0.9  # per finished drafting stretch, of the mean stretch length's evidence
OVERHEAD_MOMENTUM = 0.9  # per measured drafting step, of the step overhead's older evidence


def held_run(rate: float, length: int) -> float:
    """The expected accepted tokens of a chain of `length`, each drafted token accepted with
    probability `rate` once the ones before it were (5.4, "Holding")."""
    return length if rate >= 1 else rate * (1 - rate**length) / (1 - rate)


def batch_tokens(cap: np.ndarray, gain: np.ndarray, axis: int = 0) -> np.ndarray:
    """What a step brings a batch whose rows gain `gain` (expected tokens beyond the step's own,
    rows along `axis`) and may still draft `cap` [B]: half the rows' mean gain and half the gain
    of the row with the most tokens left, times B (ALGORITHMS.md 5.3, "A batch is judged whole").
    A static batch's call lasts until its slowest row is done, so a step that brings most rows
    four tokens and that one a single token is worth little more than a plain step; the rows it
    moves ahead still count for half, since they leave the batch sooner and its later steps cost
    less (the gate's count, 5.4, whose half weight was measured). At B = 1: 1 + e."""
    shape = [1] * gain.ndim
    shape[axis] = -1
    left = cap.reshape(shape)
    rows = gain.shape[axis]
    slowest = 1 + left.max() - (left - gain).max(axis)
    return (rows + gain.sum(axis) + rows * slowest) / 2


@dataclass
class ChainPlan:
    """One step's routing of a batch: per row the SSM that drafts (NO_SSM: none) and the length."""

    ssm: list[int]  # [B] the SSM drafting each row (NO_SSM: none)
    lengths: list[int]  # [B] tokens to draft (0: none)
    depth_index: int  # the grid depth drafted (index into the predictor's depths); -1: plain step
    predicted: list[list[float]]  # [B][D] the drafting SSM's raw f at every grid depth (rows drafting)
    max_depths: list[float]  # [B] tokens each row may still draft
    profiled: tuple[float, float]  # the profile's (verify, drafting) seconds of the step (5.2)
    advantage: float = 1.0  # the rule's score of the plan over a plain step's (1: plain)

    def action(self, row: int) -> str:
        """Row `row`'s action, as the benchmark's action lines name it."""
        length = self.lengths[row]
        return "plain" if length == 0 else f"SSM {self.ssm[row]} x{length}"

    def routes(self) -> list[tuple[int, list[bool]]]:
        """Each drafting SSM, in order, with its rows (a mask over the batch)."""
        return [(i, [s == i for s in self.ssm]) for i in sorted({s for s in self.ssm if s != NO_SSM})]

    def select(self, keep: list[int]) -> ChainPlan:
        """The plan of rows `keep` only."""
        return replace(
            self,
            ssm=[self.ssm[b] for b in keep],
            lengths=[self.lengths[b] for b in keep],
            predicted=[self.predicted[b] for b in keep],
            max_depths=[self.max_depths[b] for b in keep],
        )

    def within(self, max_depths: Sequence[float]) -> ChainPlan:
        """This plan with no row drafting more than its `max_depths` tokens (itself if none does)."""
        lengths = [min(n, int(m)) for n, m in zip(self.lengths, max_depths, strict=True)]
        if lengths == self.lengths:
            return self
        ssm = [i if n else NO_SSM for i, n in zip(self.ssm, lengths, strict=True)]
        return replace(self, ssm=ssm, lengths=lengths, max_depths=list(max_depths))


class ChainRouter:
    """Chooses a `ChainPlan` per step (`plan`) and learns from what the LLM accepted (`observe`);
    the corrections (sections 5.1, 5.2) persist across calls, as the workload's do."""

    def __init__(
        self,
        predictor: MatchLengthPredictor,
        cost_model: CostModel,
        calibration: float | None = 0.9,
        cost_correction: float | None = 0.9,
        max_subsets: int = 64,
    ) -> None:
        c = predictor.config
        if 1 not in c.widths:
            raise ValueError(
                f"routing chains needs the predictor's width-1 estimates; its widths are {c.widths}: "
                "train the predictor with width 1 in its grid"
            )
        if not cost_model.has_chain_costs or list(cost_model.chain_depths) != list(c.depths):
            raise ValueError(
                "the hardware profile has no chain costs for the predictor's depths "
                f"{list(c.depths)}: profile again with `specboost profile` (same depths)"
            )
        for name, momentum in (("calibration", calibration), ("cost_correction", cost_correction)):
            if momentum is not None and not 0 <= momentum < 1:
                raise ValueError(f"{name} is a momentum in [0, 1) (or None: off), got {momentum}")
        self.num_ssms = c.num_ssms
        self.max_hold = MAX_HOLD  # `DecisionPacing`
        self.depths = np.asarray(c.depths)
        self._depths = list(c.depths)  # as Python ints: read every step, where numpy scalars cost more
        self.predictor = predictor
        self._head = predictor.head(1)
        if self._head.w1.device.type == "cuda":  # a CUDA graph reads them in place, not copied per replay
            for tensor in self._head:
                torch._dynamo.mark_static_address(tensor)
        self._predict_on_host = predictor.on_host(1)
        # A state of this size is the head's output, from an LLM pass that applied it (`pass_head`);
        # None where it would not tell a hidden state from an estimate.
        estimates = c.num_ssms * len(c.depths)
        self._in_pass: int | None = estimates if estimates != c.input_size else None
        self.cost_model = cost_model
        self._momenta = (calibration, cost_correction)
        everyone = range(self.num_ssms)
        subsets = [s for r in range(1, len(everyone) + 1) for s in itertools.combinations(everyone, r)]
        if len(subsets) > max_subsets:
            subsets = [(i,) for i in everyone] + [tuple(everyone)]
        self.subsets = np.zeros((len(subsets), self.num_ssms), dtype=bool)  # [U, S]
        for u, members in enumerate(subsets):
            self.subsets[u, list(members)] = True
        self.costs_on_compiled_loop(False)

    def costs_on_compiled_loop(self, compiled: bool) -> None:
        """Take the profile's costs of the compiled loop (when it has them, else the eager ones,
        which the online correction then scales) or of the eager loop; starts the corrections
        afresh. The decoder says which loop runs."""
        self._compiled_loop = compiled
        self.compiled = compiled and self.cost_model.has_compiled_chain_costs
        self._tables: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._one: dict[bool, tuple[list[float], list[list[float]], list[float]]] = {}
        self._plain: dict[int, ChainPlan] = {}
        self.forget()

    def sibling(self) -> ChainRouter:
        """A router with this one's predictor, profile, momenta and loop, and online corrections
        of its own (`RoutedScheduler.router_for`)."""
        other = ChainRouter(self.predictor, self.cost_model, *self._momenta)
        other.costs_on_compiled_loop(self._compiled_loop)
        return other

    def forget(self) -> None:
        """Start the online corrections afresh (see `LearnedScheduler.forget`)."""
        calibration, cost_correction = self._momenta
        self.calibration = (
            None
            if calibration is None
            else OnlineCalibration(
                self.num_ssms, 1, tuple(self.depths.tolist()), calibration, torch.device("cpu"), slopes=True
            )
        )
        self.stretches = Stretches(self.num_ssms)
        self.overhead = StepOverhead()
        self._idle = 0  # plain steps whose ageing of the evidence is still to apply (`_age`)
        self._setups = setup_count()
        plain = max(float(self.cost_model.chain_verify_time(1, np.array([1]))[0]), 1e-9)
        cheapest = max(float(self._costs(1)[1][:, 1].min()), 1e-9)
        # Drafting steps correct (v, g); plain steps their own verify factor: a pass after the
        # SSMs' passes finds the LLM's weights out of the CPU's caches, a plain step after a plain
        # step does not, so one factor for both would misprice one of them.
        self.costs, self.plain_costs = (
            (None, None)
            if cost_correction is None
            else (
                CostCorrection(cost_correction, plain, cheapest),
                CostCorrection(cost_correction, plain, cheapest),
            )
        )

    @property
    def cost_factors(self) -> tuple[float, float, float]:
        """(v, g, v_plain): the verify and drafting factors of drafting steps, the verify factor of
        plain steps (section 5.2), the plain steps since the last decision aged in."""
        self._age()
        if self.costs is None or self.plain_costs is None:
            return (1.0, 1.0, 1.0)
        return (*self.costs.factors, self.plain_costs.factors[0])

    def plain_step_seconds(self, rows: int) -> float:
        """What a plain step of `rows` rows costs on the running loop, as far as the profile and
        the online corrections say: its one-token pass by the lower of the verify factors (v
        carries an eager profile over to a compiled loop, where no plain step was measured yet;
        v_plain, once measured, the caches' warmth in a stretch of plain steps). The speculation
        gate prices its first trial of plain decoding with it (section 5.4)."""
        v, _, v_plain = self.cost_factors
        return float(self._costs(rows)[0][0]) * min(v, v_plain)

    def _costs(self, rows: int, sampled: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(verify [D + 1] seconds of a plain step, then of every depth; drafting [S, rows + 1, D] of
        greedy chains, or of `sampled` ones (host trees); catch-up [S]: what an SSM's drafting of
        these rows costs more when a row is further behind than one compiled pass takes, its eager
        pass's cost over its compiled one's, section 5.3)."""
        key = (rows, sampled)
        if key not in self._tables:
            nodes = np.concatenate([[1], 1 + self.depths])
            draft = self.cost_model.chain_draft_table(rows, self.compiled, sampled)
            eager = self.cost_model.chain_draft_table(rows, False, sampled) if self.compiled else draft
            self._tables[key] = (
                self.cost_model.chain_verify_time(rows, nodes, self.compiled),
                draft,
                np.maximum(eager[:, rows, 0] - draft[:, rows, 0], 0.0),
            )
        return self._tables[key]

    def _costs_one(self, sampled: bool) -> tuple[list[float], list[list[float]], list[float]]:
        """`_costs` of one row, as lists: verify [D + 1], drafting [S][D], catch-up [S]."""
        if sampled not in self._one:
            verify, draft, catch_up = self._costs(1, sampled)
            self._one[sampled] = (verify.tolist(), draft[:, 1].tolist(), catch_up.tolist())
        return self._one[sampled]

    def pass_head(self, device: torch.device) -> PassHead | None:
        """What an LLM's passes on `device` that return hidden states apply to them, for this
        router: its predictor's width-1 estimates (`predict` reads them as they come); None: it
        reads the hidden states (its predictor is on another device, or its estimates are as many
        as the hidden state's size). Deciding right after the LLM's pass, with the CPU's caches
        full of the LLM, the predictor's dozen numpy calls had cost 0.20-0.24 ms a step
        (ALGORITHMS.md 5.3, "Cost of deciding"); in the compiled pass they are three small matmuls
        more."""
        return None if self._in_pass is None or self._head.w1.device != device else self._head

    def predict(self, hidden: list[torch.Tensor | None], texts: list[list[int]] | None = None) -> np.ndarray:
        """[B, S, D] the predictor's width-1 match estimates; 0 for a row without a hidden state (a
        one-token prompt's first step: nothing to route on, so it decodes plainly). A row's state is
        its hidden state, or the estimates themselves where the LLM's pass applied `pass_head`.
        `texts`, the rows' tokens, are for routers that read them (the oracle's true lengths)."""
        known = [b for b, h in enumerate(hidden) if h is not None]
        shape = (self.num_ssms, len(self.depths))
        if not known:
            return np.zeros((len(hidden), *shape))
        states = (
            hidden[0][None] if len(known) == len(hidden) == 1 else torch.stack([hidden[b] for b in known])
        )
        if states.shape[-1] == self._in_pass:  # estimates already
            out = states.float().cpu().numpy().reshape(len(known), *shape)
        elif states.device.type == "cpu":  # numpy: a fraction of torch's per-call dispatch
            host = states if states.dtype in (torch.float32, torch.float64) else states.float()
            out = self._predict_on_host(host.numpy())  # [known, S, D]
        else:
            with torch.no_grad():
                out = apply_head(states, self._head).cpu().numpy().reshape(len(known), *shape)
        if len(known) == len(hidden):
            return out
        f = np.zeros((len(hidden), *shape), dtype=out.dtype)
        f[known] = out
        return f

    def _predict_one(self, state: torch.Tensor | None, texts: list[list[int]] | None) -> list[list[float]]:
        """`predict` of one row, as [S][D] lists; with no numpy call where the LLM's pass gave the
        estimates (`pass_head`)."""
        if state is None or state.shape[-1] != self._in_pass:
            return self.predict([state], texts)[0].tolist()
        flat, depths = state.tolist(), len(self._depths)
        return [flat[i * depths : (i + 1) * depths] for i in range(self.num_ssms)]

    def plan(
        self,
        hidden: list[torch.Tensor | None],
        max_depths: list[int],
        pacing: DecisionPacing | None = None,
        texts: list[list[int]] | None = None,
        behind: Callable[[], Sequence[Sequence[int]]] | None = None,
        sampled: bool = False,
    ) -> ChainPlan:
        """The step's routing for rows with these hidden states (and texts) and tokens still
        wanted; with `pacing` (the group's), a plain step or the held plan without deciding when it
        says so.
        `behind()` [B][S]: the tokens SSM i's cache must catch row b up on before it drafts (None:
        one each, as after a step it drafted); asked only where a catch-up can cost more.
        `sampled`: the rows draft host trees (sampled or processed chains), priced by their own
        table."""
        self._setups = setup_count()
        if pacing is not None and not pacing.due():
            held = None if pacing.held is None else pacing.held.within(max_depths)
            return held if held is not None and any(held.lengths) else self.plain(max_depths)
        plan = self._rule(hidden, max_depths, texts, behind, sampled)
        if pacing is not None:
            pacing.decided(plan, self.max_hold)
        return plan

    def _rule(
        self,
        hidden: list[torch.Tensor | None],
        max_depths: list[int],
        texts: list[list[int]] | None,
        behind: Callable[[], Sequence[Sequence[int]]] | None,
        sampled: bool,
    ) -> ChainPlan:
        """The rule's plan for these rows (`plan`'s arguments), on the estimates as corrected now."""
        self._age()
        lines = None if self.calibration is None else self.calibration.lines  # [S][D] slopes, offsets
        if len(hidden) == 1:
            estimates, most = self._predict_one(hidden[0], texts), float(max_depths[0])  # [S][D]
            if lines is None:
                f = [[min(x, most) for x in row] for row in estimates]
            else:
                rows = zip(estimates, *lines, strict=True)
                f = [[min(max(x * b + c, 0.0), most) for x, b, c in zip(*row, strict=True)] for row in rows]
            late = behind()[0] if behind is not None and any(self._costs_one(sampled)[2]) else None
            return self._choose_one(f, estimates, [most], late, sampled)
        else:
            raw, cap = self.predict(hidden, texts), np.asarray(max_depths, dtype=np.float64)
            line = (
                raw if lines is None else np.maximum(raw * np.asarray(lines[0]) + np.asarray(lines[1]), 0.0)
            )
            f = np.minimum(line, cap[:, None, None])
            late = behind() if behind is not None and self._costs(len(hidden), sampled)[2].any() else None
            return self.choose(f, raw, cap, late, sampled)

    def opening(
        self,
        hidden: list[torch.Tensor | None],
        max_depths: list[int],
        texts: list[list[int]] | None = None,
        sampled: bool = False,
    ) -> ChainPlan:
        """The rule's plan of a step from these states, deciding nothing: its `advantage` is the
        speculation gate's context, its action the hold's preference for the call (ALGORITHMS.md
        5.4, "A new context", "Holding")."""
        return self._rule(hidden, max_depths, texts, None, sampled)

    def choose(
        self,
        f: np.ndarray,
        raw: np.ndarray,
        cap: np.ndarray,
        behind: Sequence[Sequence[int]] | None = None,
        sampled: bool = False,
    ) -> ChainPlan:
        """The rule (module doc) on corrected estimates `f` [B, S, D], rows `behind` [B, S],
        drafting `sampled` chains or greedy ones."""
        rows = f.shape[0]
        if rows == 1:
            late = None if behind is None else behind[0]
            return self._choose_one(f[0].tolist(), raw[0].tolist(), cap.tolist(), late, sampled)
        verify, draft, catch_up = self._costs(rows, sampled)
        v, g, v_plain = self.cost_factors
        verify_s = verify * v + self.overhead.seconds  # a drafting step's whole time but its drafting
        verify_s[0] = verify[0] * v_plain
        late = np.zeros((rows, self.num_ssms), bool)
        if behind is not None:
            late = np.asarray(behind) > COMPILED_MAX_CHAIN
        catch_up_s = late * (g * catch_up / self.stretches.mean)  # [B, S], amortised (module doc)
        route = self._route(f, verify_s, g * draft, catch_up_s, cap)
        if route is None:
            return self.plain(cap)
        ssm, d, advantage = route
        length = int(self.depths[d])
        lengths = [min(length, int(c)) if i != NO_SSM else 0 for i, c in zip(ssm, cap, strict=True)]
        ssm[np.asarray(lengths) == 0] = NO_SSM  # rows with no token left to draft
        if not any(lengths):
            return self.plain(cap)
        predicted = raw[np.arange(rows), np.maximum(ssm, 0)].tolist()  # [B][D]
        # What the profile says the drafting costs, eager catch-ups included (charged or not), for
        # the correction g to compare with the measured seconds (5.2).
        drafting_s = 0.0
        for i in {int(i) for i in ssm if i != NO_SSM}:
            mine = ssm == i
            drafting_s += draft[i, mine.sum(), d] + catch_up[i] * late[mine, i].any()
        profiled = (float(verify[1 + d]), float(drafting_s))
        return ChainPlan(ssm.tolist(), lengths, int(d), predicted, cap.tolist(), profiled, advantage)

    def _choose_one(
        self,
        f: list[list[float]],
        raw: list[list[float]],
        cap: list[float],
        behind: Sequence[int] | None,
        sampled: bool,
    ) -> ChainPlan:
        """The rule at batch 1, the argmax over (SSM i, depth d) and "plain" of (1 + f_i(d)) /
        seconds, in plain Python over the [S][D] estimates `f` (`raw`: before their corrections):
        it runs every drafting step, and there, with the LLM's pass just done, each numpy call on
        arrays this small cost about 10 us (numpy's code and data gone from the CPU's caches:
        deciding by numpy took 0.3-0.5 ms a step). The batch rule's arithmetic at B = 1, in the
        same order: the same choice."""
        verify, draft, catch_up = self._costs_one(sampled)
        v, g, v_plain = self.cost_factors
        late = [behind is not None and behind[i] > COMPILED_MAX_CHAIN for i in range(self.num_ssms)]
        mean, overhead = self.stretches.mean, self.overhead.seconds
        plain = best = 1 / (verify[0] * v_plain)
        choice = None
        for i, (estimates, seconds) in enumerate(zip(f, draft, strict=True)):
            extra = (g * catch_up[i] / mean if late[i] else 0.0) + overhead
            for d, (match, drafting) in enumerate(zip(estimates, seconds, strict=True)):
                score = (1 + match) / (verify[1 + d] * v + g * drafting + extra)
                if score > best:
                    best, choice = score, (i, d)
        length = 0 if choice is None else min(self._depths[choice[1]], int(cap[0]))
        if not length:
            return self.plain(cap)
        i, d = choice
        profiled = (verify[1 + d], draft[i][d] + (catch_up[i] if late[i] else 0.0))
        return ChainPlan([i], [length], d, [raw[i]], cap, profiled, best / plain)

    def held(self, ssm: int, depth_index: int, max_depths: Sequence[float], sampled: bool) -> ChainPlan:
        """SSM `ssm`'s chain of grid depth `depth_index` for every row, decided on nothing: the
        speculation gate's held regime (ALGORITHMS.md 5.4, "Holding"). A row with fewer tokens
        wanted drafts fewer; with none left for any row, the plain plan. Its estimates are zeros:
        nothing learns from its steps but the costs (`observe_costs`; `observe` must not see them)."""
        self._setups = setup_count()  # a step's seconds are evidence if nothing is set up after this
        lengths = [min(self._depths[depth_index], int(m)) for m in max_depths]
        if not any(lengths):
            return self.plain(max_depths)
        verify, draft, _ = self._costs(len(lengths), sampled)
        drafting = sum(1 for n in lengths if n)
        profiled = (float(verify[1 + depth_index]), float(draft[ssm, drafting, depth_index]))
        nothing = [[0.0] * len(self.depths) for _ in lengths]
        ssms = [ssm if n else NO_SSM for n in lengths]
        return ChainPlan(ssms, lengths, depth_index, nothing, list(max_depths), profiled)

    def held_depth(self, ssm: int, rate: float, rows: int, sampled: bool) -> int | None:
        """The grid depth (an index) at which SSM `ssm`'s chain, held for `rows` rows, brings the
        most tokens per second, each drafted token accepted with probability `rate` once the ones
        before it were: a chain of d tokens then brings 1 + rate (1 - rate^d) / (1 - rate) (d + 1
        at rate 1) per row, for the step's seconds as the rule prices them (5.3: the profile's,
        corrected by the measured steps, held ones included: 5.2);
        None where a plain step brings more (the rule's price of it, as `_choose_one`'s).
        The hold's length (5.4, "Holding"): the router's preferred length is priced on its
        predictor's estimates, which held steps do not correct (on quick-r40 a qa call whose trial
        held SSM 1's chain of 16 ran 162 tokens/s against 205-242 for the calls off, where fixed
        chains of 4 ran 1.22x our plain loop)."""
        if rows == 1:  # every held step runs this: plain Python on lists, as `_choose_one` decides
            verify, draft, _ = self._costs_one(sampled)
            drafting = draft[ssm]
        else:
            verify_table, draft_table, _ = self._costs(rows, sampled)
            verify, drafting = verify_table.tolist(), draft_table[ssm, rows].tolist()
        v, g, v_plain = self.cost_factors
        overhead = self.overhead.seconds
        scores = []
        for d, length in enumerate(self._depths):
            scores.append((1 + held_run(rate, length)) / (verify[1 + d] * v + g * drafting[d] + overhead))
        best = max(range(len(scores)), key=scores.__getitem__)
        return best if scores[best] > 1 / (verify[0] * v_plain) else None

    def plain(self, max_depths: Sequence[float]) -> ChainPlan:
        """A plain step for every row (nothing drafted); one shared plan per batch size (nothing
        reads a plain plan's estimates or depths)."""
        rows = len(max_depths)
        if rows not in self._plain:
            nothing = [[0.0] * len(self.depths) for _ in range(rows)]
            profiled = (float(self._costs(rows)[0][0]), 0.0)
            self._plain[rows] = ChainPlan([NO_SSM] * rows, [0] * rows, -1, nothing, [0.0] * rows, profiled)
        return self._plain[rows]

    def _route(
        self,
        f: np.ndarray,
        verify: np.ndarray,
        draft: np.ndarray,
        catch_up: np.ndarray,
        cap: np.ndarray,
    ) -> tuple[np.ndarray, int, float] | None:
        """A batch: the best (depth, SSM set) routing, then K = 0 per row; None if plain is better.
        `cap` [B]: the tokens each row may still draft. Costs are corrected: `verify` [D + 1],
        `draft` [S, B + 1, D], `catch_up` [B, S] (an SSM's one catch-up pass is eager if any row
        routed to it is far behind). Returns each row's SSM (NO_SSM: none), the depth index and
        the routing's score over a plain step's (before K = 0 per row, which only raises it)."""
        rows = f.shape[0]
        masked = np.where(self.subsets[:, None, :, None], f[None], -np.inf)  # [U, B, S, D]
        best = masked.argmax(2)  # [U, B, D] each row's SSM in U
        gain = np.take_along_axis(masked, best[:, :, None], 2)[:, :, 0]  # [U, B, D]
        mine = best[..., None] == np.arange(self.num_ssms)  # [U, B, D, S]
        routed = mine.sum(1)  # [U, D, S] rows per SSM
        depth = np.arange(len(self.depths))
        drafting = draft[np.arange(self.num_ssms), routed, depth[None, :, None]].sum(-1)  # [U, D]
        if catch_up.any():
            drafting += (mine * catch_up[None, :, None, :]).max(1).sum(-1)
        tokens = batch_tokens(cap, gain, axis=1)  # [U, D]
        score = tokens / (verify[1:] + drafting)
        u, d = np.unravel_index(score.argmax(), score.shape)
        if rows / verify[0] >= score[u, d]:
            return None
        advantage = float(score[u, d] * verify[0] / rows)
        ssm, e = best[u, :, d].copy(), gain[u, :, d]
        counts = routed[u, d].copy()
        tokens_kept, verify_s, drafting_s = float(tokens[u, d]), float(verify[1 + d]), float(drafting[u, d])
        # K = 0 per row, the least promising rows first; never the last one: a step with no row
        # drafting is a plain step, priced above at plain steps' own cost (v_plain), not as a
        # verify of 1 + d tokens with no drafting. A row's draft is worth half its e_b and half
        # what the slowest row's gain loses without it (`batch_tokens`), updated in plain Python:
        # `batch_tokens` per row took a batch-8 decision from 145 us to 203 us, this 182 us
        left, gains = cap.tolist(), e.tolist()
        behind = [r - x for r, x in zip(left, gains, strict=True)]  # each row's tokens left, after
        for b in np.argsort(e)[:-1]:
            i = ssm[b]
            marginal = draft[i, counts[i], d] - draft[i, counts[i] - 1, d]
            slowest, behind[b] = max(behind), left[b]
            lost = (gains[b] + rows * (max(behind) - slowest)) / 2
            if lost * (verify_s + drafting_s) >= tokens_kept * marginal:
                behind[b] -= gains[b]  # kept: the row with the most tokens left may be worth more
                continue
            ssm[b], counts[i] = NO_SSM, counts[i] - 1
            tokens_kept, drafting_s = tokens_kept - lost, drafting_s - marginal
        return ssm, int(d), advantage

    def observe(
        self,
        plan: ChainPlan,
        accepted: list[int],
        verify_seconds: float,
        drafting_seconds: float,
        step_seconds: float | None = None,
    ) -> None:
        """Correct the estimates with each drafting row's accepted tokens (5.1) and the costs with
        the step's measured seconds (5.2). `step_seconds`, where the caller times the whole step
        (from the end of the step before, the loop's own work included): a plain step's cost is
        that, a drafting step's overhead is what it took beyond its verification and drafting
        (`StepOverhead`). A step that drafted nothing only corrects plain steps' cost; what it
        ages (the estimates, the drafting steps' costs: so that drafting is tried again) is aged
        at the next decision, all such steps at once (`_age`): declining costs a few float
        operations per step, as plain decoding costs nothing to decide."""
        measured = setup_count() == self._setups  # else it compiled or warmed: its seconds say nothing
        drafting = [b for b, length in enumerate(plan.lengths) if length]
        if not drafting:
            self._idle += 1
            if self.plain_costs is not None and measured:
                whole = verify_seconds if step_seconds is None else step_seconds
                self.plain_costs.update((whole, 0.0), plan.profiled)
            return
        self._age()
        if self.calibration is not None:
            self.calibration.observe(
                [
                    Draft(plan.ssm[b], plan.predicted[b], plan.depth_index, accepted[b], plan.max_depths[b])
                    for b in drafting
                ]
            )
        self.stretches.observe({plan.ssm[b] for b in drafting})
        self.observe_costs(plan, verify_seconds, drafting_seconds, step_seconds)

    def observe_costs(
        self,
        plan: ChainPlan,
        verify_seconds: float,
        drafting_seconds: float,
        step_seconds: float | None = None,
    ) -> None:
        """Correct the drafting steps' costs (5.2) with one drafting step of `plan`, as `observe`
        does, and nothing else: a step of the speculation gate's held regime (5.4, "Holding")
        carries no estimate to correct, but its seconds are the costs of the path that runs. At
        batch 1 nearly every speculating step is held; where only the router's own steps
        corrected the costs, the held chain's length was priced on the profile alone. A plan that
        drafts nothing corrects nothing here (a plain step's cost is `observe`'s)."""
        if self.costs is None or setup_count() != self._setups or not any(plan.lengths):
            return  # no drafting step, or one that compiled or warmed: no evidence
        self._age()
        self.costs.update((verify_seconds, drafting_seconds), plan.profiled)
        if step_seconds is not None:
            remainder = step_seconds - verify_seconds - drafting_seconds
            self.overhead.observe(remainder, sum(plan.profiled))

    def _age(self) -> None:
        """Apply the ageing of the plain steps since the last one applied: the estimates' and the
        drafting steps' costs' evidence decay by IDLE_DECAY per step (5.1, 5.2), and every drafting
        stretch has ended."""
        if not self._idle:
            return
        if self.calibration is not None:
            self.calibration.idle(self._idle)
        if self.costs is not None:
            self.costs.idle((0, 1), self._idle)
        self.overhead.idle(self._idle)
        self.stretches.observe(())
        self._idle = 0


class Stretches:
    """How many consecutive steps an SSM drafts once it starts: the mean length of its drafting
    stretches, over all SSMs, decayed (STRETCH_MOMENTUM) with a prior of one one-step stretch. An
    SSM that starts drafting after sitting out catches up first, and that pass serves the whole
    stretch; the rule charges each step its share (section 5.3, "Catching up")."""

    def __init__(self, num_ssms: int) -> None:
        self.running = [0] * num_ssms  # steps of each SSM's stretch in progress
        self.total, self.count = 1.0, 1.0  # decayed sums of finished stretches' lengths and number

    @property
    def mean(self) -> float:
        return self.total / self.count

    def observe(self, drafting: Iterable[int]) -> None:
        """One step: the SSMs that drafted in it."""
        drafted = set(int(i) for i in drafting)
        for i, steps in enumerate(self.running):
            if i in drafted:
                self.running[i] = steps + 1
            elif steps:
                self.total = STRETCH_MOMENTUM * self.total + steps
                self.count = STRETCH_MOMENTUM * self.count + 1
                self.running[i] = 0


class StepOverhead:
    """What a drafting step costs beyond its LLM pass and its drafting, in seconds (ALGORITHMS.md
    5.2, "The whole step"): decayed sums (OVERHEAD_MOMENTUM) of the measured remainders, each at
    most COST_RANGE's upper bound times the step's profiled seconds, over their number plus one
    pseudo-step at 0 that never decays; while the router declines the sums fade (IDLE_DECAY per
    step, `idle`) and the overhead with them, as the drafting costs drift back to the profile's
    (5.2), so that drafting is tried again. Unbounded and never fading, one step that paid for
    something else (the oracle's lookahead generation, 0.3 s against 3 ms steps) had priced every
    drafting action out for the rest of the run. The rule adds it to every drafting action's
    seconds: a cost per step favours fewer, longer steps, and the profile, which times the passes
    alone, does not show it."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0.0  # decayed sums of the remainders and of their number

    @property
    def seconds(self) -> float:
        return self.total / (self.count + 1)

    def observe(self, seconds: float, profiled: float) -> None:
        """One drafting step's remainder, clipped to [0, COST_RANGE[1] x its `profiled` seconds]."""
        self.total = OVERHEAD_MOMENTUM * self.total + min(max(seconds, 0.0), COST_RANGE[1] * profiled)
        self.count = OVERHEAD_MOMENTUM * self.count + 1

    def idle(self, steps: int) -> None:
        """`steps` steps drafted nothing: the evidence fades towards the prior (no overhead)."""
        self.total *= IDLE_DECAY**steps
        self.count *= IDLE_DECAY**steps


class DecisionPacing:
    """When to decide (ALGORITHMS.md 5.3, "Pacing"). Deciding (the rule, and before a plain step
    the predictor's head in the LLM's pass) costs a few percent of a step on a small model on a
    CPU; so a decision that repeats the last one is trusted for a few steps:

    - after a plain decision the next ones come 1, 2, 4 then MAX_SKIP plain steps later;
    - a drafting decision that repeats the last one (every row the same SSM and length) is held:
      the next 1, 2, then up to `max_hold` steps draft it without deciding (their passes still
      return the hidden states: `RoutedDrafting.wants_hidden`);
    - any other decision, or a restart (new rows), brings back deciding every step;
    - a drafting step whose drafts all matched nothing ends the hold and its doubling (`observe`).

    Where speculation does not pay, deciding then costs about a ninth of what it would; where the
    router keeps choosing one chain, about a fifth; a change of what pays is seen a few steps late,
    unless the drafts miss outright: on the CPU stand-in of a large LLM (2026-11-28) a chain of 16
    that matches nothing costs about four plain steps."""

    def __init__(self) -> None:
        self.skip = 0  # steps to take without deciding after the next repeated decision
        self.wait = 0  # steps still to take before deciding again
        self.held: ChainPlan | None = None  # the drafting plan those steps take (None: plain steps)
        self._last: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # the last decision's action

    def due(self) -> bool:
        if self.wait:
            self.wait -= 1
            return False
        return True

    def decided(self, plan: ChainPlan, max_hold: int) -> None:
        action = (tuple(plan.ssm), tuple(plan.lengths))
        plain = plan.depth_index < 0
        repeated = action == self._last
        if plain:
            self.skip = min(max(1, 2 * self.skip), MAX_SKIP) if repeated else 1
        else:
            self.skip = min(max(1, 2 * self.skip), max_hold) if repeated else 0
        self.wait = self.skip
        self.held = None if plain or not self.skip else plan
        self._last = action

    def observe(self, plan: ChainPlan, accepted: Sequence[int]) -> None:
        """After a step of `plan` whose rows accepted `accepted` drafted tokens: where it drafted
        and no row's draft matched anything, the next step decides, on estimates that have just
        learned the miss (5.1), and a repeat is held from one step again."""
        drafted = [a for a, length in zip(accepted, plan.lengths, strict=True) if length]
        if drafted and not any(drafted):
            self.skip = self.wait = 0
            self.held = None

    def select(self, keep: list[int]) -> None:
        """Rows `keep` only stay (the held plan's rows)."""
        if self.held is not None:
            self.held = self.held.select(keep)
        if self._last is not None:
            ssm, lengths = self._last
            self._last = (tuple(ssm[b] for b in keep), tuple(lengths[b] for b in keep))

    def restart(self) -> None:
        self.skip = self.wait = 0
        self.held = self._last = None


class PreferredAction:
    """What the speculation gate's held regime drafts (ALGORITHMS.md 5.4, "Holding"): the drafting
    action (SSM, grid depth) the router has drafted most, each step's rows weighing one step
    together and older steps decayed by PREFERENCE_MOMENTUM per drafting step, and each SSM's
    measured acceptance, by which `ChainRouter.held_depth` prices the held chain's length. Plain
    steps do not count: the gate weighs plain decoding as a regime of its own."""

    def __init__(self) -> None:
        self.weights: dict[tuple[int, int], float] = {}
        # per SSM, decayed sums of its chains' accepted tokens and of the chains a mismatch cut
        self.accepted: dict[int, float] = {}
        self.stops: dict[int, float] = {}

    def observe(self, plan: ChainPlan) -> None:
        """One step the router planned (decided, or held by `DecisionPacing`)."""
        drafting = [i for i in plan.ssm if i != NO_SSM]
        if not drafting:
            return
        for key in self.weights:
            self.weights[key] *= PREFERENCE_MOMENTUM
        for i in drafting:
            key = (i, plan.depth_index)
            self.weights[key] = self.weights.get(key, 0.0) + 1 / len(drafting)

    def seed(self, plan: ChainPlan) -> None:
        """New rows start and `plan` is the rule's choice on their prompts (`ChainRouter.opening`):
        counted as a step, its action then weighs one step more than the heaviest did, so that a
        hold drafts what the rule chooses for this context rather than what the calls before
        drafted, until the router's own steps outweigh it. A plain plan leaves the preference as
        it is. The weights stay below 1 / (1 - PREFERENCE_MOMENTUM) + 1 however many calls come:
        a seed of the whole history's weight plus one had doubled the total at every call, and a
        server's weights had overflowed after about a thousand calls."""
        lead = max(self.weights.values(), default=0.0)
        self.observe(plan)
        for i in {i for i in plan.ssm if i != NO_SSM}:
            key = (i, plan.depth_index)
            self.weights[key] = max(self.weights[key], PREFERENCE_MOMENTUM * lead + 1)

    @property
    def action(self) -> tuple[int, int] | None:
        """(SSM, depth index) of the heaviest action; None before the router drafted."""
        return max(self.weights, key=self.weights.__getitem__) if self.weights else None

    def outcome(self, plan: ChainPlan, accepted: Sequence[int]) -> None:
        """A drafting step of `plan` (decided or held) whose rows accepted `accepted` tokens of
        their chains: each drafting row's chain is a run of accepted tokens, cut by a mismatch
        where it accepted fewer than it drafted. Older steps decay by ACCEPTANCE_MOMENTUM."""
        rows = [(i, n, a) for i, n, a in zip(plan.ssm, plan.lengths, accepted, strict=True) if n]
        if rows:
            self._add(1, [(i, matched, matched < drafted) for i, drafted, matched in rows])

    def walked(self, ssm: int, accepted: int, stops: int, steps: float) -> None:
        """SSM `ssm`'s chains walked in hindsight along text decoded plainly, `steps` drafting
        steps' worth (a shadow check that passed: 5.4, "Shadow checks"), counted as drafted, so
        that the hold's first length after it is priced on the text at hand."""
        self._add(steps, [(ssm, accepted, stops)])

    def _add(self, steps: float, runs: Sequence[tuple[int, float, float]]) -> None:
        """`steps` drafting steps whose chains accepted and were cut as `runs` says, per SSM."""
        for sums in (self.accepted, self.stops):
            for i in sums:
                sums[i] *= ACCEPTANCE_MOMENTUM**steps
        for i, matched, stopped in runs:
            self.accepted[i] = self.accepted.get(i, 0.0) + matched
            self.stops[i] = self.stops.get(i, 0.0) + stopped

    def rate(self, ssm: int) -> float | None:
        """The probability that SSM `ssm`'s next drafted token is accepted, given the ones before
        it were: accepted tokens over accepted tokens and mismatches, the maximum-likelihood rate
        of run lengths that are geometric, a whole chain accepted being a run cut short; None
        before it drafted."""
        accepted, stops = self.accepted.get(ssm, 0.0), self.stops.get(ssm, 0.0)
        return accepted / (accepted + stops) if accepted + stops > 0 else None
