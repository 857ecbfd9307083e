"""Several tokens of an SSM's chain in ONE compiled call (ALGORITHMS.md sections 2, 3, 5.3).

A chain of d tokens is a catch-up pass, which gives the first token, then d - 1 one-token passes,
each feeding the token before and choosing the next from the logits after it. Called one by one,
each of those passes pays the compiled call's entry (dynamo's guards, the wrapper) and the cache's
bookkeeping on the host, which for a small SSM on a CPU is most of the pass: on the tiny fixture's
0.31M-parameter SSM (2-core Xeon, compiled, one row) a one-token pass took 370-460 us a token
through `TreeCache.feed_column`, of which the generated kernels about 130. `chain_block` unrolls
n such passes into one function, compiled as one graph, the choice staying on the device and
feeding the next pass inside the graph.

Greedy (no `draws`), the choice is the argmax. Measured there side by side: 3 tokens 734 us
against 1820 (245 us a token), 7 tokens 1218 against 4006 (174), 15 tokens 1522 against 6887
(101); the tokens equal. Sampled, each pass applies the row's `ChainWarp` (temperature, top-k,
top-p) to the logits, keeps q and draws the next token from it by inverting its cumulative sum
(`sampling.inverse_cdf`) at a uniform number drawn before the call, so the graph holds no random
state and its draws are draws from the q it returns, which MSS verifies them with. One pass a
token, a sampled chain had also paid the row's processors, a softmax and a draw on the host: 0.64-0.74
ms a drafted token at T = 0.8 on the tiny fixture against 0.37-0.38 for a greedy one in blocks
(quick-r36, "Drafting cost per drafted token").

A compiled graph costs compiling time by its length (11 s for 3 tokens, 24 s for 7, 51 s for 15
there, per cache rows and capacity), so the cache feeds a chain in blocks of `CHAIN_BLOCKS` tokens
(`TreeCache.feed_argmax`, `TreeCache.feed_sampled`), the rest one pass at a time.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, StaticCache

from specboost.speculator.attention_layout import AttentionLayout
from specboost.speculator.kv_cache import Draws, tree_pass
from specboost.speculator.sampling import inverse_cdf, warped_probs


def chain_block(
    model: PreTrainedModel,
    cache: StaticCache,
    token: torch.Tensor,  # [B] long: the token to feed first
    positions: torch.Tensor,  # [B, 1] long: its position, each row's committed length
    visible: torch.Tensor,  # [B, 1, 1] bool: a fed node sees itself
    counts: torch.Tensor,  # [B + 2] long: as `tree_pass`'s, for the first token
    layout: AttentionLayout,
    dtype: torch.dtype,
    steps: int,
    draws: Draws | None = None,  # a sampled block's warp and uniform numbers [B, steps]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Feed `token`, then `steps` - 1 times the token chosen after the token fed last (the argmax,
    or with `draws` a draw from q), each committed at its row's next position (every row as wide as
    the cache: no pending nodes, one length); returns the token chosen after each fed token,
    [B, steps] (the last one is not fed), as `steps` calls of `TreeCache.feed_column` would; with
    `draws` also the q each was drawn from, [B, steps, V]."""
    chosen, qs = [], []
    for step in range(steps):
        at = positions + step
        fed = (token[:, None], at, visible, at, counts + step)
        logits, _ = tree_pass(model, cache, *fed, layout, dtype, False)
        if draws is None:
            token = logits[:, 0].float().argmax(-1)  # as `generate`: argmax of float32 scores
        else:
            warp, uniform = draws
            q = warped_probs(logits[:, 0], *warp)
            token = inverse_cdf(q, uniform[:, step : step + 1])[:, 0]
            qs.append(q)
        chosen.append(token)
    tokens = torch.stack(chosen, 1)
    return tokens if draws is None else (tokens, torch.stack(qs, 1))
