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
    With `keep_hidden`, `hidden` is the LLM's last-layer state at the newest cached token (the
    one whose logits chose the root), for the learned scheduler (ALGORITHMS.md section 5).
    """

    def __init__(self, llm: PreTrainedModel, prompt: list[int], keep_hidden: bool = False) -> None:
        self.llm = llm
        self.tokens = list(prompt)
        self.cache = new_cache()
        self.keep_hidden = keep_hidden
        self.hidden: torch.Tensor | None = None  # [H]
        self._tree_hidden: torch.Tensor | None = None  # [N, H] of the last verified tree
        if len(prompt) > 1:
            with torch.no_grad():
                out = causal_forward(llm, self.cache, prompt[:-1], output_hidden=keep_hidden)
            self.hidden = out.hidden[-1] if keep_hidden else None

    @property
    def prefix_length(self) -> int:
        """Cached positions: every verified token but the root."""
        return len(self.tokens) - 1

    @torch.no_grad()
    def tree_logits(self, tree: TokenTree) -> torch.Tensor:
        """ONE forward pass over the whole tree with tree attention; [N, V] logits."""
        out = tree_forward(
            self.llm, self.cache, tree, range(len(tree)), self.prefix_length, output_hidden=self.keep_hidden
        )
        self._tree_hidden = out.hidden
        return out.logits

    def keep_accepted(self, accepted: list[int]) -> None:
        """Compact the cache to prefix + root + accepted nodes (fed in node order after the prefix)."""
        p = self.prefix_length
        compact_cache(self.cache, [*range(p + 1), *(p + u for u in accepted)])
        if self._tree_hidden is not None:
            self.hidden = self._tree_hidden[accepted[-1] if accepted else 0]

    def append(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
