"""Sequoia speculation: one SSM fills a DP-optimal token tree every step (ALGORITHMS.md
sections 3 and 8). The acceptance vector comes from `specboost.training.sequoia_acceptance`
(`python -m specboost.training.sequoia_trees` measures it and prints the best trees);
`SpeculativeDecoder(strategy="sequoia")` builds this speculator from a pool's files.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specboost.speculator.drafter import PoolDrafter
from specboost.speculator.sequoia_acceptance import AcceptanceVector
from specboost.speculator.sequoia_dp import optimal_tree
from specboost.speculator.sequoia_hardware import CostModelLike, TreeChoice, choose_tree_size, relative_costs
from specboost.speculator.speculation import DraftRequest, StepFeedback, ssm_generator
from specboost.speculator.tree import DraftKind, TokenTree


class SequoiaSpeculator:
    """SSM number `index` of a pool fills one fixed Sequoia tree each step: top-k children
    (greedy) or children sampled without replacement (sampling); the drafter clips it to
    `DraftRequest.max_depth`. The tree is the DP optimum for `acceptance` with `nodes` nodes (and
    depth <= `depth`), or, given a `cost_model`, the hardware-aware choice of size and depth over
    n <= max_nodes and d <= max_depth."""

    def __init__(
        self,
        ssm: PreTrainedModel,
        acceptance: AcceptanceVector,
        *,
        nodes: int | None = None,
        depth: int | None = None,
        cost_model: CostModelLike | None = None,
        index: int = 0,
        max_nodes: int = 128,
        max_depth: int = 16,
    ) -> None:
        if (nodes is None) == (cost_model is None):
            raise ValueError("give the tree size (nodes=, optionally depth=) or a cost_model, not both")
        self.acceptance = acceptance
        self.choice: TreeChoice | None = None
        if cost_model is not None:
            t, c = relative_costs(cost_model, index)
            self.choice = choose_tree_size(acceptance.marginal, t, c, max_nodes, max_depth)
            nodes, depth = self.choice.nodes, self.choice.depth
        self.tree = optimal_tree(acceptance.marginal, nodes, depth)
        self.index = index  # the SSM's index in the pool, which tree nodes record
        self.drafter = PoolDrafter([ssm], [index])
        self.num_ssms = 1  # one q per node: sampling without replacement stays lossless
        self.wants_hidden = False
        self._generator: torch.Generator | None = None

    @property
    def predicted_gain(self) -> float:
        """What the tree is expected to buy: the predicted speedup over plain decoding with a
        cost model, else the expected tokens per step (F(T) of ALGORITHMS.md section 8)."""
        return self.choice.speedup if self.choice is not None else self.tree.expected_tokens

    def tree_kind(self, do_sample: bool, seeded: bool = False) -> DraftKind:
        return self.tree.shape.kind(do_sample)

    def reset(self, seed: int | None) -> None:
        self.drafter.reset()
        self._generator = ssm_generator(seed, self.index, self.drafter.models[0].device)

    def propose(self, request: DraftRequest) -> TokenTree:
        return self.drafter.draft_one(
            request.verified, self.tree.shape, request.probs, request.max_depth, self._generator
        )

    def observe(self, feedback: StepFeedback) -> None:
        """The tree is fixed; nothing to learn per step."""

    def report(self) -> dict:
        out = {
            "strategy": "sequoia",
            "ssm": self.index,
            "nodes": self.tree.nodes,
            "depth": self.tree.depth,
            "expected_tokens_per_step": self.tree.expected_tokens,
            "acceptance_rule": self.acceptance.rule,
            "parents": list(self.tree.shape.parents),
        }
        if self.choice is not None:
            out["predicted_speedup"] = self.choice.speedup
        return out
