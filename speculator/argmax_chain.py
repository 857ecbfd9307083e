"""Several tokens of an SSM's argmax chain in ONE compiled call (ALGORITHMS.md sections 3, 5.3).

A greedy chain of d tokens is a catch-up pass, which gives the first token, then d - 1 one-token
passes, each feeding the token before and taking the argmax after it. Called one by one, each of
those passes pays the compiled call's entry (dynamo's guards, the wrapper) and the cache's
bookkeeping on the host, which for a small SSM on a CPU is most of the pass: on the tiny fixture's
0.31M-parameter SSM (2-core Xeon, compiled, one row) a one-token pass took 370-460 us a token
through `TreeCache.feed_column`, of which the generated kernels about 130. `argmax_chain` unrolls
n such passes into one function, compiled as one graph: the argmax stays on the device and feeds
the next pass inside the graph. Measured there side by side: 3 tokens 734 us against 1820 (245 us
a token), 7 tokens 1218 against 4006 (174), 15 tokens 1522 against 6887 (101); the tokens equal.

A compiled graph costs compiling time by its length (11 s for 3 tokens, 24 s for 7, 51 s for 15
there, per cache rows and capacity), so the cache feeds a chain in blocks of `CHAIN_BLOCKS` tokens
(`TreeCache.feed_argmax`), the rest one pass at a time.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, StaticCache

from specboost.speculator.attention_layout import AttentionLayout
from specboost.speculator.kv_cache import tree_pass


def argmax_chain(
    model: PreTrainedModel,
    cache: StaticCache,
    token: torch.Tensor,  # [B] long: the token to feed first
    positions: torch.Tensor,  # [B, 1] long: its position, each row's committed length
    visible: torch.Tensor,  # [B, 1, 1] bool: a fed node sees itself
    counts: torch.Tensor,  # [B + 2] long: as `tree_pass`'s, for the first token
    layout: AttentionLayout,
    dtype: torch.dtype,
    steps: int,
) -> torch.Tensor:
    """Feed `token`, then `steps` - 1 times the argmax after the token fed last, each committed at
    its row's next position (every row as wide as the cache: no pending nodes, one length); returns
    the argmax after each fed token, [B, steps] (the last one is not fed), as `steps` calls of
    `TreeCache.feed_column` would."""
    chosen = []
    for step in range(steps):
        at = positions + step
        fed = (token[:, None], at, visible, at, counts + step)
        logits, _ = tree_pass(model, cache, *fed, layout, dtype, False)
        token = logits[:, 0].float().argmax(-1)  # as `generate`: argmax of float32 scores
        chosen.append(token)
    return torch.stack(chosen, 1)
