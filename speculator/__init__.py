"""Token trees, tree attention and SSM drafting.

Sections cited as "ALGORITHMS.md section N" are those of docs/ALGORITHMS.md in the repository.
"""

from specboost.speculator.drafter import PoolDrafter
from specboost.speculator.shapes import BeamShape, ChainShape, DraftShape, TopologyShape
from specboost.speculator.speculation import PoolSpeculator, Speculator
from specboost.speculator.tree import DraftKind, Proposal, TokenTree, merge_trees

__all__ = [
    "BeamShape",
    "ChainShape",
    "DraftKind",
    "DraftShape",
    "PoolDrafter",
    "PoolSpeculator",
    "Proposal",
    "Speculator",
    "TokenTree",
    "TopologyShape",
    "merge_trees",
]
