"""Measure the hardware cost model on this machine (ALGORITHMS.md sections 5 and 8).

    specboost profile --llm PATH --pool POOL_DIR            # writes POOL_DIR/hardware_profile.json

Everything is timed through the decoder's own code paths: L_verify(n) is the LLM's `TreeCache`
pass over an n-node tree after `prefix_length` cached tokens, followed by the commit a real step
does (the root kept); L_speculate(b, d) is `PoolDrafter.draft_one` of a beam tree after the same prefix
(the steady-state cache catch-up of one token included). Each number is the median of `repeats`
timed runs after one warm-up run; CUDA is synchronised around every run.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specboost.decoder.validation import model_name
from specboost.speculator.cost_model import CostModel, device_key
from specboost.speculator.drafter import PoolDrafter
from specboost.speculator.kv_cache import TreeCache, capacity_for
from specboost.speculator.predictor import DEPTHS, WIDTHS
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.shapes import BeamShape, ChainShape
from specboost.speculator.tree import TokenTree, TreeBatch


@dataclass(frozen=True)
class ProfileConfig:
    widths: tuple[int, ...] = WIDTHS
    depths: tuple[int, ...] = DEPTHS
    verify_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    prefix_length: int = 64
    repeats: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.prefix_length < 1:
            raise ValueError("repeats and prefix_length must be >= 1")
        if min(self.verify_sizes) < 1:
            raise ValueError("verify sizes count tree nodes, root included: they must be >= 1")


def _interleaved_medians(
    runs: dict[str, Callable[[], object]], repeats: int, device: torch.device, show_progress: bool
) -> dict[str, float]:
    """Median seconds of every run, timed round-robin (`repeats` rounds after one warm-up round),
    so that a burst of load on a shared machine spreads over all shapes instead of skewing one."""
    times: dict[str, list[float]] = {key: [] for key in runs}
    with tqdm(
        total=(repeats + 1) * len(runs), desc="profiling", unit="run", disable=not show_progress
    ) as bar:
        for round_index in range(repeats + 1):
            for key, run in runs.items():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if round_index > 0:  # round 0 warms up
                    times[key].append(time.perf_counter() - start)
                bar.update(1)
    return {key: statistics.median(values) for key, values in times.items()}


def bushy_tree(size: int, vocab: int, max_depth: int, gen: torch.Generator) -> TokenTree:
    """A tree of `size` nodes made of chains of at most `max_depth` hanging off the root (what
    beam trees of the configuration grid look like), with random tokens."""
    tree = TokenTree.root_only(int(torch.randint(vocab, (1,), generator=gen)))
    parent = 0
    for _ in range(size - 1):
        if tree.depths[parent] >= max_depth:
            parent = 0
        token = int(torch.randint(vocab, (1,), generator=gen))
        parent = tree.add_child(parent, token, 0)
    return tree


@torch.no_grad()
def profile(
    llm: PreTrainedModel,
    ssms: list[PreTrainedModel],
    config: ProfileConfig | None = None,
    show_progress: bool = True,
) -> CostModel:
    """Measure L_verify over tree sizes and L_speculate over the (b, d) grid for every SSM."""
    config = config or ProfileConfig()
    gen = torch.Generator().manual_seed(config.seed)
    vocab = llm.get_output_embeddings().weight.shape[0]
    prefix = torch.randint(vocab, (config.prefix_length,), generator=gen).tolist()
    device = llm.device
    sizes = sorted(set(config.verify_sizes))
    target = TreeCache(llm, 1, capacity_for(len(prefix) + max(sizes)))
    target.feed_chains([prefix[:-1]], eager=True)

    def verify(tree: TokenTree) -> None:
        batch = TreeBatch.pack([tree], device=device)
        target.feed(batch.tokens, target.lengths[0] + batch.depths, batch.ancestors)
        target.commit([[0]])  # what a step does after the pass...
        target.truncate(0, len(prefix) - 1)  # ...then back to the same prefix

    runs: dict[str, Callable[[], object]] = {}
    for size in sizes:
        runs[f"verify {size}"] = functools.partial(verify, bushy_tree(size, vocab, max(config.depths), gen))
    probs = LogitsToProbs(SamplingConfig())
    for index, ssm in enumerate(ssms):
        drafter = PoolDrafter([ssm], [index])
        drafter.draft_one(prefix, ChainShape(1), probs, 1)  # fill the cache: timed runs catch up one token
        runs[f"ssm {index} step"] = functools.partial(drafter.draft_one, prefix, ChainShape(1), probs, 1)
        for width in config.widths:
            for depth in config.depths:
                shape = BeamShape(width, depth)
                runs[f"ssm {index} {width},{depth}"] = functools.partial(
                    drafter.draft_one, prefix, shape, probs, depth
                )
    pool = PoolDrafter(ssms) if len(ssms) > 1 else None
    if pool is not None and pool.stacked:  # one step of every SSM at once
        steps = [ChainShape(1)] * len(ssms)
        pool.draft(prefix, steps, probs, 1)
        runs["pool step"] = functools.partial(pool.draft, prefix, steps, probs, 1)
    seconds = _interleaved_medians(runs, config.repeats, device, show_progress)
    verify_seconds = [seconds[f"verify {size}"] for size in sizes]
    steps = [seconds[f"ssm {i} step"] for i in range(len(ssms))]
    speculate = [
        {f"{b},{d}": seconds[f"ssm {i} {b},{d}"] for b in config.widths for d in config.depths}
        for i in range(len(ssms))
    ]
    return CostModel(
        device=device_key(device, llm.dtype),
        verify_tokens=sizes,
        verify_seconds=verify_seconds,
        speculate_seconds=speculate,
        ssm_step_seconds=steps,
        prefix_length=config.prefix_length,
        pool_step_seconds=seconds.get("pool step"),
        llm=model_name(llm),
        ssms=[model_name(s) for s in ssms],
    )
