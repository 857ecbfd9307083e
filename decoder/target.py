"""The LLM side: its KV cache, the verified tokens, and the verification passes."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specboost.speculator.kv_cache import compact_cache, new_cache
from specboost.speculator.tree import TokenTree
from specboost.speculator.tree_attention import causal_forward, tree_forward


class TargetState:
    """Verified tokens of one sequence and the LLM cache over all of them but the last.

    The last verified token (the root of the next tree) is not yet in the cache: every
    verification pass feeds it as node 0 of the tree, so its logits come from the same pass.
    """

    def __init__(self, llm: PreTrainedModel, prompt: list[int]) -> None:
        self.llm = llm
        self.tokens = list(prompt)
        self.cache = new_cache()
        if len(prompt) > 1:
            with torch.no_grad():
                causal_forward(llm, self.cache, prompt[:-1])

    @property
    def prefix_length(self) -> int:
        """Cached positions: every verified token but the root."""
        return len(self.tokens) - 1

    @torch.no_grad()
    def tree_logits(self, tree: TokenTree) -> torch.Tensor:
        """ONE forward pass over the whole tree with tree attention; [N, V] logits."""
        return tree_forward(self.llm, self.cache, tree, range(len(tree)), self.prefix_length).logits

    def keep_accepted(self, accepted: list[int]) -> None:
        """Compact the cache to prefix + root + accepted nodes (fed in node order after the prefix)."""
        p = self.prefix_length
        compact_cache(self.cache, [*range(p + 1), *(p + u for u in accepted)])

    def append(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
