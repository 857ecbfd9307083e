"""Lossless speculative decoding with a pool of SSMs: `SpeculativeDecoder`.

Sections cited as "ALGORITHMS.md section N" are those of docs/ALGORITHMS.md in the repository.
"""

from specboost.decoder.decoder import SpeculativeDecoder, SpeculativeOutput
from specboost.decoder.pool import SSMPool
from specboost.decoder.stats import DecodeStats
from specboost.decoder.strategies import StrategyOptions
from specboost.decoder.verify import Rule
from specboost.speculator.shapes import BeamShape, ChainShape, TopologyShape

__all__ = [
    "BeamShape",
    "ChainShape",
    "DecodeStats",
    "Rule",
    "SSMPool",
    "SpeculativeDecoder",
    "SpeculativeOutput",
    "StrategyOptions",
    "TopologyShape",
]
