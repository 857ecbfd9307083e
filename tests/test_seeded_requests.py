"""A seeded sampled request gives the same tokens in the serving engine whatever shares its batch:
its chain length is its strategy's own, not the batch controller's (which follows the other rows),
so its random draws depend on its seed alone. Both ways of drafting a batch: the pool's chains
drafted together, and a speculator copy per row (several sampled chains per SSM). The routed
scheduler decides for the whole batch, but its seeded rows are verified by the target rule, which
draws one sample per emitted token whatever was drafted (their chains only guess those draws:
ALGORITHMS.md 5.3, "Seeded rows")."""

from __future__ import annotations

import pytest
from test_greedy_equivalence import _noisy, llm_for
from test_scheduler import FAVOURS_SSM_0, SPECULATE, VERIFY, constant_predictor, cost_table

from specboost.decoder import ChainShape, SpeculativeDecoder
from specboost.decoder.engine import Engine, EngineConfig

TIMEOUT = 60.0
PROMPT = [3, 1, 4, 1, 5]
SAMPLED = {"max_new_tokens": 24, "do_sample": True, "temperature": 0.9}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(shape=ChainShape(3)),
        dict(shape=ChainShape(2, samples=2), rule="k_sequential"),
        dict(
            strategy="learned",
            predictor=constant_predictor(FAVOURS_SSM_0),
            cost_model=cost_table(2, VERIFY, SPECULATE),
        ),
    ],
    ids=["batched-chains", "per-row-speculators", "routed"],
)
def test_a_seed_gives_the_same_tokens_alone_and_beside_other_requests(kwargs: dict) -> None:
    decoder = SpeculativeDecoder(llm_for("llama", 0), _noisy(0.1, 0.3)("llama", 0), **kwargs)
    with Engine(decoder, EngineConfig(batch_size=4, num_groups=1)) as engine:

        def seeded(seed: int) -> list[int]:
            return engine.submit(PROMPT, seed=seed, **SAMPLED).result(TIMEOUT).new_tokens

        alone = [seeded(seed) for seed in (11, 12)]
        busy = [engine.submit([2, 7, 1, 8][:n], **(SAMPLED | {"max_new_tokens": 60})) for n in (1, 2, 4)]
        assert [seeded(seed) for seed in (11, 12)] == alone
        assert all(len(h.result(TIMEOUT).new_tokens) == 60 for h in busy)
