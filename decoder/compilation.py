"""Compiled model calls: `torch.compile` of the LLM's verify pass and the SSMs' drafting passes at
fixed shapes (PERFORMANCE.md: static caches and compiled steps are where the fastest decoders win
back a step's overhead).

Every pass feeds a `TreeCache` whose shapes come from a few buckets (rows and nodes padded to powers
of two, capacities to multiples of 32 or 128), so a handful of graphs cover every shape and strategy;
on the CPU the capacity and the rows past one are dynamic sizes of the graphs (`dynamic_sizes`), so
one graph serves every capacity, and every batch of 2 to 8 rows.
What is compiled is the whole tree pass (`speculator.kv_cache.tree_pass`: the tree-attention mask
and the model's forward), so that the mask is built inside the graph. On CUDA with CUDA graphs
(`mode="reduce-overhead"`); on the CPU with inductor's C++ wrapper (`cpp_wrapper`), which calls the
generated kernels without a Python wrapper per kernel (a small model's forward is dominated by that
wrapper otherwise). Prompts and other long passes run eagerly (`COMPILED_MAX_NODES`). A graph is
compiled the first time its shape is met: call `SpeculativeDecoder.warmup` to pay that before timing
anything. A strategy whose shapes vary from step to step (the learned scheduler: a beam (b, d) or
nothing per SSM and step; a pool's merged tree, as large as its SSMs disagree) registers every shape
it can produce (`expect_passes`), and they are all
compiled the first time a cache of some rows and capacity meets the call (`CompiledPass`). The
graphs of a model are shared by every decoder of the process that compiles it (`shared_functions`).
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import weakref
from collections.abc import Callable
from types import FunctionType
from typing import Literal

import torch
from torch._inductor import list_mode_options
from transformers import PreTrainedModel

from specboost.speculator.chain_block import chain_block
from specboost.speculator.kv_cache import (
    CHAIN_BLOCKS,
    COMPILED_MAX_CHAIN,
    COMPILED_MAX_NODES,
    ChainFunction,
    CompiledFunctions,
    CompiledPass,
    PassFunction,
    PassShape,
    function_limit,
    node_bucket,
    tree_pass,
)
from specboost.speculator.majority import MajoritySpeculator
from specboost.speculator.routed_scheduler import RoutedScheduler
from specboost.speculator.scheduler import LearnedScheduler
from specboost.speculator.shapes import BeamShape, ChainShape, DraftShape
from specboost.speculator.speculation import PoolSpeculator, Speculator

CompileSetting = bool | Literal["auto"]
# Each model's compiled functions with the state of the model they were made for (`shared_functions`).
_SHARED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[object, ...], CompiledFunctions]] = (
    weakref.WeakKeyDictionary()
)
ACCUMULATED_LIMIT = 1024  # graphs of all models of a process together (a benchmark compiles many)


def compile_by_default(device: torch.device) -> bool:
    """compile="auto": compile on CUDA (CUDA graphs take the per-kernel launch cost away, the
    dominant cost of a small model's step there); run eagerly on other devices, where compiling
    takes minutes and gains less (see the `+compiled` rows in docs/results.md)."""
    return device.type == "cuda"


def check_can_compile(device: torch.device) -> None:
    """Raise a RuntimeError naming the fallback when this machine cannot compile for `device`."""
    if device.type == "cpu":
        compiler = os.environ.get("CXX", "g++")
        if shutil.which(compiler) is None and shutil.which("c++") is None:
            raise RuntimeError(
                f"compile=True needs a C++ compiler for inductor's CPU code ({compiler!r} was not found): "
                "install one (e.g. g++) or use compile=False"
            )


class ModelCalls:
    """The compiled tree pass of each model of a decoder, compiled when first asked for (None for
    every model when compiling is off)."""

    def __init__(self, device: torch.device, enabled: bool = False) -> None:
        self.enabled = enabled
        self.device = device
        self._calls: dict[int, CompiledPass] = {}
        if enabled:
            check_can_compile(device)
            config = torch._dynamo.config
            config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, ACCUMULATED_LIMIT)

    def get(self, model: PreTrainedModel) -> CompiledPass | None:
        if not self.enabled:
            return None
        if id(model) not in self._calls:
            make = functools.partial(compiled_tree_pass, model.device)
            # Chains in compiled blocks, argmax and sampled, on the CPU only, where they were
            # measured (speculator/chain_block.py); on CUDA they are not measured yet.
            block = functools.partial(compiled_block, model.device) if model.device.type == "cpu" else None
            self._calls[id(model)] = CompiledPass(
                make,
                store=shared_functions(model),
                make_chain=block,
                make_sampled=block,
                dynamic_capacity=dynamic_sizes(model.device),
                # A stacked pool's rows are blocks of its members' (`stack_pool`), never padded
                dynamic_rows=dynamic_sizes(model.device) and getattr(model, "stacked_members", 1) == 1,
            )
        return self._calls[id(model)]

    def expect_chains(self, model: PreTrainedModel, longest: int) -> None:
        """Register the argmax-chain blocks `model`'s greedy chains of up to `longest` tokens feed
        (`chain_blocks`): one-row caches compile them where they first meet a capacity. Nothing
        where the call makes no blocks (on CUDA), so that no warm-up asks for them."""
        call = self.get(model)
        if call is not None and call.make_chain is not None:
            call.expected_chains.update(chain_blocks(longest))

    def expect_passes(self, llm: PreTrainedModel, speculator: Speculator) -> None:
        """Register the pass shapes a strategy can produce with the compiled calls of the LLM and of
        its SSMs: a cache compiles them all where it first meets a capacity (in a warm-up), not in
        the step where a shape first turns up. The learned schedulers' shapes vary from step to step
        (ALGORITHMS.md section 5): every beam of the grid (and the fallback) may be cut to any
        shallower depth near the end of a sequence, any SSM may sit a step out, and a routed chain
        (5.3) may be of any length up to the deepest of the grid, or none. A pool of a fixed shape
        varies too: its merged tree is as small as one SSM's draft where they all agree and as large
        as all of them where none does, and a weighted majority (section 6) sends the voted chain,
        cut short where its voted SSMs change: a warm-up generation meets some of those sizes only
        (`majority+compiled` compiled a graph in a timed run of the quick suite, r17 and r18)."""
        if not self.enabled:
            return
        if isinstance(speculator, RoutedScheduler):
            longest = 1 + int(speculator.router.depths.max())
            # The router's estimates come out of the LLM's verify pass (5.3, "Cost of deciding"):
            # its current router's, should the scheduler's router be replaced
            self.get(llm).head = lambda: speculator.router.pass_head(llm.device)
            self.get(llm).expected.update(verify_passes(longest, hidden=True))
            # without the states: a plain step while the gate is off, a held chain (5.4)
            self.get(llm).expected.update(verify_passes(longest, hidden=False))
            for model in speculator.models:
                self.get(model).expected.update({*catch_up_passes(), PassShape(1, 1, False)})
                self.expect_chains(model, longest - 1)
            return
        if isinstance(speculator, LearnedScheduler):
            fallback = speculator.fallback
            grid = {*speculator.options[1:], (fallback.width, fallback.depth)}
            beams = {(b, depth) for b, d in grid for depth in range(1, d + 1)}
            # The LLM verifies the merged tree: at most every SSM's largest beam, under one root.
            largest = 1 + speculator.num_ssms * max(b * d for b, d in beams)
        elif isinstance(speculator, PoolSpeculator) and speculator.length_controller is None:
            beam = pool_beam(speculator.shape)
            if beam is None:
                return
            width, depth = beam
            beams = {(width, d) for d in range(1, depth + 1)}
            merged = 1 if isinstance(speculator, MajoritySpeculator) else speculator.num_ssms
            largest = 1 + merged * width * depth
        else:
            return
        # The LLM verifies trees of 1..largest nodes; each drafting unit catches up and drafts any
        # of `beams` (b, d) per SSM, or nothing.
        self.get(llm).expected.update(verify_passes(largest, speculator.wants_hidden))
        for unit in speculator.drafter.units:
            call = self.get(unit.model)
            call.expected.update(catch_up_passes())
            call.expected.update(level_passes(beams, len(unit.rows)))
            shape = getattr(speculator, "shape", None)  # one SSM's greedy chains (`draft_greedy`)
            if isinstance(shape, ChainShape) and shape.samples == 1 and len(unit.rows) == 1:
                self.expect_chains(unit.model, shape.length)


def verify_passes(largest: int, hidden: bool) -> set[PassShape]:
    """The LLM's passes over trees of 1..`largest` nodes (padded to their buckets; larger ones run
    eagerly), returning hidden states or not."""
    sizes = {node_bucket(n) for n in range(1, largest + 1)}
    return {PassShape(n, n, hidden) for n in sizes if n <= COMPILED_MAX_NODES}


def pool_beam(shape: DraftShape) -> tuple[int, int] | None:
    """(nodes per level, depth) of one SSM's draft of a fixed `shape`; None for a topology (not
    registered: a warm-up generation meets its one tree)."""
    if isinstance(shape, ChainShape):
        return shape.samples, shape.length
    if isinstance(shape, BeamShape):
        return shape.width, shape.depth
    return None


def shared_functions(model: PreTrainedModel) -> CompiledFunctions:
    """The compiled passes of `model` made so far in this process, by every decoder that compiled
    it: a new decoder over the same models compiles only the pass keys none met before (the
    benchmark suite builds one per method and decoding, and compiled the learned scheduler's LLM
    passes once per decoder: on quick-r11 its warm-ups took 18 of 52 minutes). The functions are kept
    per state of the model (`model_state`): on the CPU a graph holds the weights it was compiled
    with (freezing), and no graph checks the model's modules at a call (`compile_options`), so a
    model whose weights were replaced or changed in place since (a `load_state_dict`, an optimizer
    step: each moves a tensor's version counter), that was put in train mode or given another
    attention implementation gets new ones. Held as long as the model lives (the functions hold no
    reference to it)."""
    state = model_state(model)
    held = _SHARED.get(model)
    if held is None or held[0] != state:
        held = _SHARED[model] = (state, CompiledFunctions(function_limit(model)))
    return held[1]


def model_state(model: PreTrainedModel) -> tuple[object, ...]:
    """What a compiled pass of `model` assumes of it: train or eval mode, the attention
    implementation, and where each parameter and buffer lives and its version (in-place writes move
    it; an inference tensor, made under `torch.inference_mode`, has none: its place alone)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    weights = tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for t in tensors)
    return model.training, getattr(model.config, "_attn_implementation", None), weights


def catch_up_passes() -> set[PassShape]:
    """A drafter's catch-up chains: the tokens verified since a row's last pass (longer ones run
    eagerly)."""
    return {PassShape(n, n, False) for n in {node_bucket(c) for c in range(1, COMPILED_MAX_CHAIN + 1)}}


def level_passes(beams: set[tuple[int, int]], rows: int) -> set[PassShape]:
    """The tree-level passes of a drafting unit of `rows` SSMs, each drafting one of `beams`
    (b, d) or nothing (`speculator/drafter.py`): level j feeds, padded, the widest beam still
    growing (b of an SSM with d > j), after the nodes of the levels before it."""
    depth = max(d for _, d in beams)
    alone = {tuple(b if d > j else 0 for j in range(1, depth)) for b, d in beams}  # widths per level
    widths = set(alone)
    for _ in range(rows - 1):  # what several SSMs of the unit feed together: the widest per level
        widths |= {tuple(map(max, these, one)) for these in widths for one in alone}
    passes = set()
    for levels in widths:
        pending = 0
        for width in filter(None, levels):
            nodes = node_bucket(width)
            passes.add(PassShape(nodes, node_bucket(pending + nodes), False))
            pending += nodes
    return passes


def chain_blocks(longest: int) -> set[int]:
    """The argmax-chain blocks (`CHAIN_BLOCKS`) that chains of up to `longest` tokens feed: a chain
    of n tokens feeds n - 1 after its first."""
    return {block for block in CHAIN_BLOCKS if block < longest}


def compiled_block(device: torch.device) -> ChainFunction:
    """`torch.compile` of a copy of `chain_block` of its own, compiled as `compiled_tree_pass` is:
    `CompiledPass` asks for one per model, block, rows (and capacity where it is static), and argmax
    or a sampled block's processing (top-k, top-p on)."""
    return compile_function(chain_block, device)


def compiled_tree_pass(device: torch.device) -> PassFunction:
    """`torch.compile` of a copy of `tree_pass` of its own: `CompiledPass` asks for one per model
    and pass key."""
    return compile_function(tree_pass, device)


def compile_function(function: FunctionType, device: torch.device) -> Callable[..., object]:
    """`torch.compile` of a copy of `function` (`own_code`) for `device`: static shapes, but for
    the cache capacity and rows where they are dynamic (`dynamic_sizes`; `dynamic=None` lets the
    marked sizes stay symbolic, and nothing else is marked, nor varies within one function's calls)."""
    dynamic = None if dynamic_sizes(device) else False
    return torch.compile(own_code(function), fullgraph=False, dynamic=dynamic, **compile_options(device))


def dynamic_sizes(device: torch.device) -> bool:
    """Whether the compiled passes take the cache capacity and the rows past one as dynamic sizes
    (`CompiledPass.sizes_key`): on the CPU, where it was measured. A graph per capacity had
    compiled every expected pass again at each capacity a table's prompts met (quick-r38: 200
    graphs, about 32 s each on a slow host), and a graph per row bucket again at each bucket a
    batch met as its rows finished; one graph for every capacity, and one for 2 to 8 rows,
    compiled as fast and ran their passes as fast (docs/results.md, "Capacity as a dynamic
    size", "Rows as a dynamic size"). On CUDA both stay static: dynamic ones have not been
    measured there (with CUDA graphs or without)."""
    return device.type == "cpu"


def own_code(function: FunctionType) -> FunctionType:
    """A copy of `function` with a code object of its own. torch.compile keeps the graphs it builds
    per code object, checked one after another at every call and capped at `recompile_limit`: one
    copy per model and pass key keeps their graphs apart, however many models a process compiles
    (the benchmark suite compiles a dozen) and however many shapes each meets."""
    return FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )


def compile_options(device: torch.device) -> dict[str, object]:
    """`torch.compile` keyword arguments per device: CUDA graphs on CUDA (`mode="reduce-overhead"`'s
    options); elsewhere inductor with its C++ wrapper and freezing (the same settings serve the
    compiled plain-decoding baseline, so that both sides of a comparison are compiled alike).
    Freezing folds the (inference-only) weights into the graph as oneDNN-packed matrices: a
    few-token linear of a small model then costs little more than a one-token one (the tiny
    fixture's LM head: 74 us for 5 tokens against 186 us unfrozen), our compiled plain step ran
    1.17x and a compiled chain step 1.28x faster; each graph holds its own packed copy of the
    weights, and compiling takes about twice as long.

    On every device dynamo's guards on the model's modules and parameters are dropped
    (`skip_guard_on_all_nn_modules_unsafe`): a compiled function serves one model in one state
    (`shared_functions`: its weights, train/eval mode and attention implementation), so they cannot
    fail, and checking them took 81 us of the tiny fixture's 0.57 ms plain step on the CPU (about 400
    guards; side by side on 12 held-out prompts, the plain loop ran 1.12x and a compiled chain 1.13x
    faster without them). A fresh dict per call: torch.compile takes the filter out of the options
    it is given."""
    guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if device.type == "cuda":
        return {"options": list_mode_options("reduce-overhead", dynamic=False) | guards}
    return {"options": {"cpp_wrapper": True, "freezing": True} | guards}
