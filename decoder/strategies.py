"""`strategy=` names of `SpeculativeDecoder`, turned into speculation strategies (`Speculator`s).

- "pool": every SSM drafts `shape`; the trees are merged (SpecInfer; the default).
- "learned": the learned scheduler, from the match-length predictor and the hardware cost model
  (ALGORITHMS.md section 5). Both come from the arguments or the `SSMPool`; without a predictor it
  falls back to "pool" with a warning, and without a profile for this device (or one without chain
  costs) it measures one first (seconds; `specboost profile` stores one). Its actions
  (`StrategyOptions.actions`): "chains" (the default; section 5.3), per step and batch plain
  decoding or one SSM's argmax chain, SSM and length chosen per row; "trees" (section 5, SpecInfer's
  rule), per step and per SSM a beam (b, d) or no draft, the SSMs' trees merged.
- "majority": every SSM drafts a greedy chain of `shape`'s length; only the weighted-majority
  chain goes to the LLM, and the SSM weights learn from its verdicts (section 6). Initial weights
  come from the `SSMPool` (else equal).
- "pruned": the merged tree of `shape` cut to its best nodes, by the same weights and the SSMs'
  own probabilities (section 6): `StrategyOptions.budget` of them, else as many as the hardware
  profile (the `cost_model` argument or the pool's for this device) says pay at each step, else 8.
- "sequoia": one SSM fills a DP-optimal tree every step (section 8). Its acceptance vector comes
  from `StrategyOptions.acceptance` or the pool's `sequoia_acceptance.json`; its size from
  `StrategyOptions.nodes`, else the hardware-aware choice with the cost model (the argument or
  the pool's hardware profile for this device). The SSM is `StrategyOptions.ssm`, else the one
  whose tree promises the most (`SequoiaSpeculator.predicted_gain`).
- "plain": speculation off: no SSMs, nothing drafted, one LLM token per step through the same
  decode loop, batches and serving engine (`speculator/no_draft.py`); the baseline the others
  are measured against. Every other strategy needs at least one SSM.

`length_controller` ("minions", "bass" or a configured `LengthController`) picks the chain
length of "pool", "majority" and "pruned" before every step (section 7); the chain then starts at
the controller's initial length (Minions 4, BASS 7), not at `shape`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

from transformers import PreTrainedModel

from specboost.decoder.pool import SSMPool
from specboost.decoder.profiler import ProfileConfig, profile
from specboost.speculator.cost_model import CostModel, device_key
from specboost.speculator.length_control import LengthController, make_length_controller
from specboost.speculator.majority import MajorityConfig, MajoritySpeculator, PrunedPoolSpeculator
from specboost.speculator.no_draft import NoDraftSpeculator
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.routed_scheduler import RoutedScheduler
from specboost.speculator.scheduler import LearnedScheduler
from specboost.speculator.sequoia import SequoiaSpeculator
from specboost.speculator.sequoia_acceptance import AcceptanceVector
from specboost.speculator.shapes import BeamShape, ChainShape, DraftShape
from specboost.speculator.speculation import PoolSpeculator, Speculator

logger = logging.getLogger(__name__)

DEFAULT_BUDGET = 8  # "pruned": drafted nodes kept per step
LEARNED_ACTIONS = ("chains", "trees")  # the learned scheduler's action spaces
CHAIN_STRATEGIES = ("pool", "majority", "pruned")  # those a length controller can drive


@dataclass(frozen=True)
class StrategyOptions:
    """The less common settings of the strategies. A field left None takes the strategy's
    default; a field set for a strategy that does not use it is refused (`OPTION_USERS`)."""

    budget: int | None = None  # "pruned": drafted nodes kept per step (default: the profile's choice, else 8)
    nodes: int | None = None  # "sequoia": tree size, root included (default: hardware-aware choice)
    depth: int | None = None  # "sequoia": depth bound of the tree, or of the hardware-aware search
    # "sequoia": one vector (for SSM `ssm`, default 0) or one per SSM (default: the pool's file)
    acceptance: AcceptanceVector | Sequence[AcceptanceVector] | None = None
    ssm: int | None = None  # "sequoia": the SSM that drafts (default: the most promising)
    majority: MajorityConfig | None = None  # "majority", "pruned": the weight update
    actions: str | None = None  # "learned": "chains" (the default) or "trees" (see the module doc)
    # "learned" with chains: the speculation gate, which turns the router off where measured plain
    # decoding is faster (ALGORITHMS.md 5.4; default True; False: the router decides every step)
    gate: bool | None = None

    def __post_init__(self) -> None:
        if self.actions not in (None, *LEARNED_ACTIONS):
            raise ValueError(
                f"actions must be one of {', '.join(map(repr, LEARNED_ACTIONS))}, got {self.actions!r}"
            )


OPTION_USERS: dict[str, tuple[str, ...]] = {  # StrategyOptions field -> the strategies that read it
    "budget": ("pruned",),
    "nodes": ("sequoia",),
    "depth": ("sequoia",),
    "acceptance": ("sequoia",),
    "ssm": ("sequoia",),
    "majority": ("majority", "pruned"),
    "actions": ("learned",),
    "gate": ("learned",),
}


@dataclass
class StrategyInputs:
    """What strategies may need beyond the models; None means 'from the pool, if any'."""

    shape: DraftShape | None = None
    predictor: MatchLengthPredictor | None = None
    cost_model: CostModel | None = None
    force_profile: bool = False
    length_controller: LengthController | str | None = None
    options: StrategyOptions = field(default_factory=StrategyOptions)


Builder = Callable[[PreTrainedModel, list[PreTrainedModel], SSMPool | None, StrategyInputs], Speculator]


def make_speculator(
    strategy: str,
    llm: PreTrainedModel,
    ssms: list[PreTrainedModel],
    pool: SSMPool | None,
    inputs: StrategyInputs,
) -> Speculator:
    if strategy not in BUILDERS:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    check_inputs(strategy, inputs)
    check_ssms(strategy, ssms)
    return BUILDERS[strategy](llm, ssms, pool, inputs)


def check_ssms(strategy: str, ssms: list[PreTrainedModel]) -> None:
    """Refuse SSMs for "plain" (they would never run), and no SSMs for every other strategy."""
    if strategy == "plain" and ssms:
        raise ValueError(
            f"strategy='plain' drafts nothing, so its {len(ssms)} SSM(s) would never run: pass ssms=[] "
            "(or pick a speculative strategy)"
        )
    if strategy != "plain" and not ssms:
        raise ValueError(
            f"strategy={strategy!r} needs at least one SSM to draft with; use strategy='plain' to "
            "decode without speculation"
        )


def check_inputs(strategy: str, inputs: StrategyInputs) -> None:
    """Refuse settings the strategy would ignore, with what to change."""
    for option in fields(StrategyOptions):
        users = OPTION_USERS[option.name]
        if getattr(inputs.options, option.name) is not None and strategy not in users:
            wanted = " or ".join(f"strategy={s!r}" for s in users)
            raise ValueError(
                f"StrategyOptions({option.name}=...) is for {wanted}; strategy={strategy!r} does not use it"
            )
    if inputs.length_controller is not None and strategy not in CHAIN_STRATEGIES:
        raise ValueError(
            f"length_controller sets chain lengths for strategy {', '.join(map(repr, CHAIN_STRATEGIES))}; "
            f"strategy={strategy!r} does not draft chains of one length"
        )
    if strategy == "majority" and not isinstance(inputs.shape, ChainShape | None):
        raise ValueError(
            f"strategy='majority' votes on chains: use shape=ChainShape(length), not {inputs.shape}"
        )
    if strategy == "majority" and isinstance(inputs.shape, ChainShape) and inputs.shape.samples > 1:
        raise ValueError(
            "strategy='majority' votes on one argmax chain per SSM, so ChainShape(samples=...) does not "
            f"apply: use shape=ChainShape({inputs.shape.length})"
        )
    if strategy == "plain" and inputs.shape is not None:
        raise ValueError("strategy='plain' drafts nothing: drop shape=")
    if strategy == "sequoia" and inputs.shape is not None:
        raise ValueError(
            "strategy='sequoia' drafts its own DP-optimal tree: drop shape= (its size and depth are "
            "StrategyOptions(nodes=, depth=))"
        )


def _length_controller(inputs: StrategyInputs) -> LengthController | None:
    controller = inputs.length_controller
    return make_length_controller(controller) if isinstance(controller, str | None) else controller


def _cost_model(llm: PreTrainedModel, pool: SSMPool | None, inputs: StrategyInputs) -> CostModel | None:
    """The given cost model, else the pool's profile for this device, else None."""
    if inputs.cost_model is not None or pool is None:
        return inputs.cost_model
    return pool.cost_model(llm.device, llm.dtype, inputs.force_profile)


def _pool(
    llm: PreTrainedModel, ssms: list[PreTrainedModel], pool: SSMPool | None, inputs: StrategyInputs
) -> Speculator:
    return PoolSpeculator(ssms, inputs.shape, _length_controller(inputs))


def _learned(
    llm: PreTrainedModel, ssms: list[PreTrainedModel], pool: SSMPool | None, inputs: StrategyInputs
) -> Speculator:
    predictor = inputs.predictor or (pool.predictor if pool is not None else None)
    if predictor is None:
        logger.warning(
            "strategy='learned' needs a match-length predictor (`make predictor`, then `make export`); "
            "none given and none in the pool: using the fixed shape %r",
            inputs.shape,
        )
        return _pool(llm, ssms, pool, inputs)
    chains = (inputs.options.actions or "chains") == "chains"
    if inputs.options.gate is not None and not chains:
        raise ValueError("StrategyOptions(gate=...) is for the routed chains; drop it with actions='trees'")
    cost = _cost_model(llm, pool, inputs)
    if cost is None or (chains and not cost.has_chain_costs):
        logger.warning(
            "no hardware profile%s for %s: measuring one now (store one with `specboost profile`)",
            "" if cost is None else " with chain costs",
            device_key(llm.device, llm.dtype),
        )
        cost = profile(
            llm, ssms, ProfileConfig(widths=predictor.config.widths, depths=predictor.config.depths)
        )
    if chains:
        return RoutedScheduler(ssms, predictor, cost, gated=inputs.options.gate is not False)
    fallback = inputs.shape if isinstance(inputs.shape, BeamShape) else None
    return LearnedScheduler(ssms, predictor, cost, fallback)


def _majority(
    llm: PreTrainedModel, ssms: list[PreTrainedModel], pool: SSMPool | None, inputs: StrategyInputs
) -> Speculator:
    length = (inputs.shape or ChainShape()).length
    weights = pool.weights if pool is not None else None
    return MajoritySpeculator(ssms, length, _length_controller(inputs), inputs.options.majority, weights)


def _pruned(
    llm: PreTrainedModel, ssms: list[PreTrainedModel], pool: SSMPool | None, inputs: StrategyInputs
) -> Speculator:
    o = inputs.options
    weights = pool.weights if pool is not None else None
    cost = _cost_model(llm, pool, inputs) if o.budget is None else None
    budget = o.budget if o.budget is not None or cost is not None else DEFAULT_BUDGET
    controller = _length_controller(inputs)
    return PrunedPoolSpeculator(ssms, inputs.shape, budget, controller, o.majority, weights, cost)


def _sequoia(
    llm: PreTrainedModel, ssms: list[PreTrainedModel], pool: SSMPool | None, inputs: StrategyInputs
) -> Speculator:
    o = inputs.options
    if o.ssm is not None and not 0 <= o.ssm < len(ssms):
        raise ValueError(f"StrategyOptions(ssm={o.ssm}) names no SSM: the pool has {len(ssms)}")
    vectors = _acceptance_vectors(o, pool, len(ssms))
    if o.nodes is not None:
        size: dict = {"nodes": o.nodes, "depth": o.depth}
    else:
        cost = _cost_model(llm, pool, inputs)
        if cost is None:
            raise ValueError(
                "strategy='sequoia' needs a tree size: StrategyOptions(nodes=N), or a hardware profile "
                "for the hardware-aware choice (cost_model=, or a pool with one: `make profile`, then "
                "`make export`)"
            )
        size = {"cost_model": cost} if o.depth is None else {"cost_model": cost, "max_depth": o.depth}
    candidates = [o.ssm] if o.ssm is not None else sorted(vectors)
    speculators = [SequoiaSpeculator(ssms[i], vectors[i], index=i, **size) for i in candidates]
    return max(speculators, key=lambda s: s.predicted_gain)


def _plain(
    llm: PreTrainedModel, ssms: list[PreTrainedModel], pool: SSMPool | None, inputs: StrategyInputs
) -> Speculator:
    return NoDraftSpeculator()


def _acceptance_vectors(
    o: StrategyOptions, pool: SSMPool | None, num_ssms: int
) -> dict[int, AcceptanceVector]:
    """SSM index -> its acceptance vector, from the options or the pool."""
    acceptance = o.acceptance if o.acceptance is not None else pool.acceptance if pool is not None else None
    if acceptance is None:
        raise ValueError(
            "strategy='sequoia' needs an acceptance vector: StrategyOptions(acceptance=...) (measure "
            "one with `python -m specboost.training.sequoia_trees`), or a pool that ships one "
            "(`make sequoia-acceptance`, then `make export`)"
        )
    if isinstance(acceptance, AcceptanceVector):
        return {o.ssm or 0: acceptance}
    if len(acceptance) != num_ssms:
        raise ValueError(
            f"{len(acceptance)} acceptance vectors for {num_ssms} SSMs: give one per SSM, or one vector "
            "and StrategyOptions(ssm=i)"
        )
    return dict(enumerate(acceptance))


BUILDERS: dict[str, Builder] = {
    "pool": _pool,
    "learned": _learned,
    "majority": _majority,
    "pruned": _pruned,
    "sequoia": _sequoia,
    "plain": _plain,
}
STRATEGIES = tuple(BUILDERS)
DRAFTING = tuple(s for s in STRATEGIES if s != "plain")  # those that speculate (a pool's choices)
