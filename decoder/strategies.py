"""`strategy=` names of `SpeculativeDecoder`, turned into speculation strategies (`Speculator`s).

- "pool": every SSM drafts `shape`; the trees are merged (SpecInfer; the default).
- "learned": the learned scheduler picks per step and per SSM a beam (b, d) or no draft, from the
  match-length predictor and the hardware cost model (ALGORITHMS.md section 5). Both come from
  the arguments or the `SSMPool`; without a predictor it falls back to "pool" with a warning, and
  without a profile for this device it measures one first (seconds; `specboost profile` stores one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import PreTrainedModel

from specboost.decoder.pool import SSMPool
from specboost.decoder.profiler import ProfileConfig, profile
from specboost.speculator.cost_model import CostModel, device_key
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.scheduler import LearnedScheduler
from specboost.speculator.shapes import BeamShape, DraftShape
from specboost.speculator.speculation import PoolSpeculator, Speculator

logger = logging.getLogger(__name__)

STRATEGIES = ("pool", "learned")


@dataclass
class StrategyInputs:
    """What strategies may need beyond the models; None means 'from the pool, if any'."""

    shape: DraftShape | None = None
    predictor: MatchLengthPredictor | None = None
    cost_model: CostModel | None = None
    force_profile: bool = False


def make_speculator(
    strategy: str,
    llm: PreTrainedModel,
    ssms: list[PreTrainedModel],
    pool: SSMPool | None,
    inputs: StrategyInputs,
) -> Speculator:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "learned":
        return _learned(llm, ssms, pool, inputs)
    return PoolSpeculator(ssms, inputs.shape)


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
        return PoolSpeculator(ssms, inputs.shape)
    cost = inputs.cost_model
    if cost is None and pool is not None:
        cost = pool.cost_model(llm.device, llm.dtype, inputs.force_profile)
    if cost is None:
        logger.warning(
            "no hardware profile for %s: measuring one now (store one with `specboost profile`)",
            device_key(llm.device, llm.dtype),
        )
        cost = profile(
            llm, ssms, ProfileConfig(widths=predictor.config.widths, depths=predictor.config.depths)
        )
    fallback = inputs.shape if isinstance(inputs.shape, BeamShape) else None
    return LearnedScheduler(ssms, predictor, cost, fallback)
