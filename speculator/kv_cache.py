"""Fixed-capacity KV caches for token trees over a batch of sequences (ALGORITHMS.md sections 1, 11).

A `TreeCache` is one model's transformers `StaticCache` with every layer a full `StaticLayer`
([rows, kv heads, capacity, head dim] per layer, allocated once), plus the number of committed
positions of each row. Row b's committed tokens (its verified text, in order) sit at positions
0 .. lengths[b] - 1, so a cache index is a text position; the rest of the row is padding, never
attended to (BASS-PAD: rows of different lengths share one padded tensor).

Token trees are fed on top, in index order: their K/V land after the widest row, at `width` =
max(lengths), as *pending* nodes that later nodes see only through their ancestor masks. `commit`
then appends to each row the pending nodes it keeps (the accepted path) by in-place index copies
and drops the others. A chain whose kept nodes are a prefix of what was fed, in a row as wide as
the batch, moves nothing. A compiled cache feeds a chain too long for its room after the widest
row in parts, rather than grow to a capacity its compiled passes have not met. Sliding-window
layers are masked by position (`AttentionLayout`), so every layer is a full one and compaction
stays exact.

With a compiled model call, shapes are kept to a few buckets (rows padded to powers of two, fed
nodes and the fed nodes they may see to `NODE_BUCKETS`, the capacity to multiples of
`CAPACITY_STEP`), so that the compiled model sees a handful of shapes (on the CPU the capacity and
the rows past one are dynamic sizes of its graphs: `CompiledPass.sizes_key`); eager passes are not
padded. A compiled call may also name the pass shapes its decoder expects (`CompiledPass`): a cache
then compiles them all the first time any cache of its rows and capacity meets the call.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import Cache, StaticLayer

from specboost.speculator.attention_layout import AttentionLayout
from specboost.speculator.model_info import CACHE_ARGUMENT, context_length, keeps_logits
from specboost.speculator.predictor import PassHead, apply_head
from specboost.speculator.sampling import ChainWarp, inverse_cdf, warped_probs
from specboost.speculator.tree_attention import tree_attention_mask

logger = logging.getLogger(__name__)

CAPACITY_STEP = 128  # capacities are multiples of this by default (a compiled graph per capacity, if static)
NODE_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)  # compiled passes: nodes per row, padded
COMPILED_MAX_NODES = NODE_BUCKETS[-1]  # passes of more nodes per row run eagerly
COMPILED_MAX_CHAIN = 8  # `feed_chains` of longer chains (prompts: one-off shapes) run eagerly
# Tokens an argmax chain's compiled block feeds in one call (`TreeCache.feed_argmax`,
# speculator/chain_block.py): a chain of 4 takes one block of 3 after its first token, one of 8
# a block of 7, one of 16 two and a pass; each block is a graph of its own per rows and capacity.
CHAIN_BLOCKS = (3, 7)
# Sampling settings (`ChainWarp.key`: top-k, top-p on) a call makes sampled blocks for: each is a
# graph per block size, SSM and capacity, compiled where a cache warms (tens of seconds on a CPU), so
# requests that vary their top-k do not each compile a set; chains under others draw one pass a token.
MAX_SAMPLED_WARPS = 2


class PassShape(NamedTuple):
    """The shape of one compiled pass, beside its cache's rows and capacity."""

    nodes: int  # new nodes per row, a `node_bucket` size
    keys: int  # fed nodes they may see (pending, then new), a `node_bucket` size
    hidden: bool  # the pass returns the last hidden states too (through the call's head, if any)


PassFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # `tree_pass`'s signature
# `chain_block`'s signature (with draws, it returns its tokens' q too)
ChainFunction = Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
# A sampled block's draws: `warped_probs`' arguments (temperature, top-p, top-k, nucleus) and the
# uniform numbers [B, steps] its tokens are drawn at (speculator/chain_block.py)
Draws = tuple[tuple[torch.Tensor, torch.Tensor, int, bool], torch.Tensor]
# Compiled functions per model call. On the CPU each graph holds its own frozen copy of the
# weights, so a call keeps at most FUNCTION_WEIGHT_BYTES of them (and between MIN_FUNCTIONS and
# MAX_FUNCTIONS functions) and runs the pass keys it meets after that eagerly, with a warning, as
# dynamo's recompile limit had. On CUDA (no freezing) the weights' size is only a proxy for what
# a graph holds (its static buffers), applied alike. A flat 64 had been too few for a small model: the learned
# scheduler's LLM call expects 11 pass shapes at each (rows, capacity) a batch meets, and at
# batch 8 on the quick suite (4 row buckets as rows finish, 3 capacities) the qa table's passes ran
# eagerly, at 0.78x our plain loop with the gate off on 99% of the steps.
FUNCTION_WEIGHT_BYTES = 2 << 30
MIN_FUNCTIONS = 64
MAX_FUNCTIONS = 1024


def function_limit(model: torch.nn.Module) -> int:
    """How many compiled functions a call of `model` keeps (see FUNCTION_WEIGHT_BYTES)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(MIN_FUNCTIONS, min(MAX_FUNCTIONS, FUNCTION_WEIGHT_BYTES // max(1, weights)))


@dataclass
class CompiledFunctions:
    """One model's compiled functions by pass key, as many as `limit` (`function_limit`); `full`:
    the limit was met and new keys run eagerly. Shared by the model's `CompiledPass`es: every
    decoder of a process that compiles the model (`compilation.shared_functions`)."""

    limit: int = MIN_FUNCTIONS
    # Pass keys (rows, nodes, keys, hidden, capacity, head...), argmax-chain keys ("chain", rows,
    # tokens, capacity) and sampled-chain keys ("sampled", rows, tokens, capacity, top-k, top-p on);
    # rows and capacity None where they are dynamic sizes (`CompiledPass.sizes_key`).
    functions: dict[tuple[object, ...], PassFunction | ChainFunction] = field(default_factory=dict)
    full: bool = False
    hidden_ready: bool = False  # `collect_hidden_states_once` ran on the model


class CompiledPass:
    """A model's compiled `tree_pass` and the pass shapes its decoder expects (`expected`, empty:
    none). The first time a cache of some (rows, capacity) meets the call, it runs every expected
    shape there, before its own pass, compiling those not compiled yet: a strategy whose shapes
    vary from step to step (the learned scheduler) then compiles nothing new once its caches' rows
    and capacities have been met (`SpeculativeDecoder.warmup`). Where the capacity is a dynamic
    size (`dynamic_capacity`, `sizes_key`), a capacity met after the first compiles nothing;
    where the rows are (`dynamic_rows`, `sizes_key`), neither does a bucket of 2 or more rows
    after the first.

    Every pass key (rows and capacity where static, nodes, fed nodes seen, hidden states or not)
    gets a function of its own from `make` (a `torch.compile` of its own copy of `tree_pass`): torch.compile
    checks a code object's graphs one after another at every call, and the learned scheduler's LLM
    call holds dozens (every verify size, with and without hidden states, at every capacity met): in a
    profile of its plain steps on the CPU, dynamo's entry took 0.36 ms a call against 0.23 ms for
    the plain loop's call. The functions live in `store`, which other calls of the same model may
    share (a key compiled by one is not compiled again by the next)."""

    def __init__(
        self,
        make: Callable[[], PassFunction],
        store: CompiledFunctions | None = None,
        make_chain: Callable[[], ChainFunction] | None = None,
        make_sampled: Callable[[], ChainFunction] | None = None,
        dynamic_capacity: bool = False,
        dynamic_rows: bool = False,
    ) -> None:
        self.make = make
        # Whether `make`'s functions take the capacity, and the rows of caches of 2 or more rows,
        # as dynamic sizes (`sizes_key`).
        self.dynamic_capacity = dynamic_capacity
        self.dynamic_rows = dynamic_rows
        self.store = store or CompiledFunctions()
        self.expected: set[PassShape] = set()
        # The argmax-chain blocks (`CHAIN_BLOCKS` sizes) a decoder expects of a one-row cache, made
        # by `make_chain` (None: none, every chain token is a pass of its own); sampled chains' blocks
        # of the same sizes by `make_sampled`, for every `ChainWarp.key` in `expected_draws`.
        self.make_chain = make_chain
        self.make_sampled = make_sampled
        self.expected_chains: set[int] = set()
        self.expected_draws: set[tuple[int, bool]] = set()
        # What a pass that returns hidden states applies to them, asked at each such pass: the
        # routed scheduler's predictor (`ChainRouter.pass_head`), so that its estimates come with
        # the verify pass's logits. Its weights are the pass's inputs, not frozen into the graph: a
        # decoder over the same model with another predictor of these sizes shares the graph.
        self.head: Callable[[], PassHead | None] | None = None
        self.met: set[tuple[int, int]] = set()  # (physical rows, capacity) of the caches warmed

    def __call__(
        self,
        model: PreTrainedModel,
        cache: StaticCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        fed_positions: torch.Tensor,
        counts: torch.Tensor,
        layout: AttentionLayout,
        dtype: torch.dtype,
        output_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.head_for(output_hidden)
        rows, capacity = self.sizes_key(cache, tokens.shape[0])
        key = (rows, tokens.shape[1], visible.shape[2], output_hidden, capacity, *(head.key if head else ()))
        inputs = (tokens, positions, visible, fed_positions, counts, layout, dtype, output_hidden)
        function = self.store.functions.get(key)
        if function is None:
            function = self._new_function(key, model, output_hidden)
            if rows is None:  # the graph is traced at this call: its inputs' rows are a dynamic size
                for tensor in inputs[:5]:
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return function(model, cache, *inputs, None, head)

    def chain(
        self,
        model: PreTrainedModel,
        cache: StaticCache,
        token: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        counts: torch.Tensor,
        layout: AttentionLayout,
        dtype: torch.dtype,
        steps: int,
        draws: Draws | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """`chain_block`'s compiled block of `steps` argmax tokens (one of `expected_chains`), or
        with `draws` sampled ones and their q; None where the call makes none or its
        functions are full (the caller feeds the tokens one by one)."""
        warp = None if draws is None else draws[0][2:]
        key = self.chain_key(cache, token.shape[0], steps, warp)
        make = self.make_chain if draws is None else self.make_sampled
        function = self.store.functions.get(key)
        if function is None:
            if make is None or not self._room(model):
                return None
            function = self.store.functions[key] = make()
        return function(model, cache, token, positions, visible, counts, layout, dtype, steps, draws)

    def chain_key(
        self, cache: FullStaticCache, rows: int, steps: int, warp: tuple[int, bool] | None = None
    ) -> tuple:
        """The function key of `chain`'s block of `steps` tokens for `rows` rows of `cache`: its
        capacity only where the call takes the capacity as a static size (`sizes_key`)."""
        return block_key(rows, steps, self.sizes_key(cache, 1)[1], warp)

    def expect_draws(self, warp: tuple[int, bool]) -> None:
        """Sampled blocks of every expected size for `warp` (a `ChainWarp.key`) from now on. A new
        one makes the call forget the (rows, capacity) it met, so that every cache warms again where
        it next feeds or warms (`TreeCache._warm`): what was compiled runs once more, the new blocks
        compile, there and not in the step where a sampled chain first needs one (a routed drafter
        drafts at the steps its SSM is chosen, which differ between a warm-up and a timed run). At
        most MAX_SAMPLED_WARPS warps: chains under others draw one pass a token."""
        draws = self.expected_draws
        if self.make_sampled is None or not self.expected_chains or warp in draws:
            return
        if len(draws) < MAX_SAMPLED_WARPS:
            draws.add(warp)
            self.met.clear()

    def sizes_key(self, cache: FullStaticCache, rows: int) -> tuple[int | None, int | None]:
        """The (rows, capacity) part of a pass key for a cache of `rows` physical rows: None for a
        size the functions take as a dynamic one, and then the cache's K/V are marked so the first
        time a call meets them (`torch._dynamo.maybe_mark_dynamic`: a model whose forward
        specialises on a size gets a graph per value, as with a static one).
        - The capacity (`dynamic_capacity`): every capacity a cache grows to runs the graphs
          already compiled. The quick suite had compiled 200 graphs, each expected pass again at
          every capacity its prompts met (docs/results.md, "Capacity as a dynamic size").
        - Rows past one (`dynamic_rows`; torch.compile specialises a size of 1 whatever is marked):
          a batch whose rows finish meets buckets of 8, 4, 2 and 1 rows, and each had compiled
          every expected pass again (the first category of quick-r39's greedy batch-8 table took 28
          minutes, mostly compiling). One graph for 2 to 8 rows ran its passes within 3% of each
          row count's own graph (docs/results.md, "Rows as a dynamic size")."""
        dynamic_rows = self.dynamic_rows and rows > 1
        if not cache.marked:
            dims = (0,) * dynamic_rows + (2,) * self.dynamic_capacity
            for layer in cache.layers:
                if layer.is_initialized:
                    for dim in dims:
                        torch._dynamo.maybe_mark_dynamic(layer.keys, dim)
                        torch._dynamo.maybe_mark_dynamic(layer.values, dim)
            cache.marked = True
        return (None if dynamic_rows else rows), (None if self.dynamic_capacity else cache_capacity(cache))

    def head_for(self, output_hidden: bool) -> PassHead | None:
        """The head a pass applies to the hidden states it returns (`head`), if it returns them."""
        return self.head() if output_hidden and self.head is not None else None

    def _new_function(
        self, key: tuple[object, ...], model: PreTrainedModel, output_hidden: bool
    ) -> PassFunction:
        """A compiled function for a key not met yet; past the store's `limit` the eager pass (said
        once). Before the first that returns hidden states, the model returns them once eagerly
        (`collect_hidden_states_once`)."""
        store = self.store
        if self._room(model):
            if output_hidden and not store.hidden_ready:
                collect_hidden_states_once(model)
                store.hidden_ready = True
            function = store.functions[key] = self.make()
            return function
        return tree_pass

    def _room(self, model: PreTrainedModel) -> bool:
        """Whether the store takes another function of `model`; said once when it no longer does."""
        store = self.store
        if len(store.functions) < store.limit:
            return True
        if not store.full:
            logger.warning(
                "%d compiled passes of %s met: passes of other shapes run eagerly (start a new decoder, "
                "or keep the lengths and batch sizes of the requests in fewer buckets)",
                store.limit,
                type(model).__name__,
            )
            store.full = True
        return False

    def __deepcopy__(self, memo: dict[int, object]) -> CompiledPass:
        return self  # shared, as the model is, by the copies of a speculator (one per sequence of a batch)


def block_key(rows: int, steps: int, capacity: int, warp: tuple[int, bool] | None = None) -> tuple:
    """A chain block's function key: argmax, or sampled under a `ChainWarp.key`."""
    return ("chain", rows, steps, capacity) if warp is None else ("sampled", rows, steps, capacity, *warp)


@torch.no_grad()
def collect_hidden_states_once(model: PreTrainedModel) -> None:
    """One eager forward of `model` on one token that returns its hidden states. transformers
    installs the hooks that collect them on a model's first call that asks for them; traced by
    torch.compile, that installation breaks the graph (a lock, the hooks' handles), and the
    function compiled there keeps its graph split in three for the process: on the CPU an 8-node
    verify pass of the tiny fixture's LLM that returns its hidden states then took 3.15 against
    2.68 ms for one that does not (median of 3000 interleaved calls), where unbroken it costs the
    same. A decoder's first pass is its prompt's, eager, which installs them, but a prompt of one
    token has no such pass."""
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    model(input_ids=token, output_hidden_states=True, use_cache=False)


class _Setup:
    """Warm-up passes run and caches grown so far in this process (`setup_count`)."""

    events = 0


def note_setup() -> None:
    """Work that sets a decoder up ran during a step (a hindsight oracle's lookahead generation):
    `setup_count` moves, and the step's seconds are not taken for decoding's."""
    _Setup.events += 1


def setup_count() -> int:
    """Graphs torch.compile has compiled (torch._dynamo's own counter), warm-up passes run and
    caches grown so far in this process: a step during which it moved measured setting up, not
    decoding. A cache's first meeting with a new capacity runs every expected pass there
    (`TreeCache._warm`, about 0.2 s at batch 8 on the quick suite's fixture): timed as a step, it had
    made plain decoding look ten times slower than it is to the speculation gate (ALGORITHMS.md 5.4)."""
    return torch._dynamo.utils.counters["frames"]["total"] + _Setup.events


def bucket(n: int) -> int:
    """The smallest power of two >= n (>= 1): a compiled model's rows are padded to it."""
    return 1 << max(0, n - 1).bit_length()


def node_bucket(n: int) -> int:
    """The nodes per row a compiled pass of `n` nodes is padded to."""
    return next((size for size in NODE_BUCKETS if size >= n), bucket(n))


def capacity_for(positions: int, step: int = CAPACITY_STEP) -> int:
    """A capacity holding `positions`, rounded up to a multiple of `step`."""
    return -(-positions // step) * step


def max_capacity(model: PreTrainedModel) -> int:
    """The most positions a cache of `model` may hold: its context and a tree's padding."""
    return capacity_for((context_length(model) or 1 << 15) + 4 * CAPACITY_STEP)


def tree_pass(
    model: PreTrainedModel,
    cache: StaticCache,
    tokens: torch.Tensor,  # [B, N] long
    positions: torch.Tensor,  # [B, N] long
    visible: torch.Tensor,  # [B, N, K] bool: the fed nodes (pending, then new) each new node sees
    fed_positions: torch.Tensor,  # [B, K] long
    counts: torch.Tensor,  # [B + 2] long: each row's committed length, then the write start and width
    layout: AttentionLayout,
    dtype: torch.dtype,  # the model's: the additive mask's
    output_hidden: bool,
    logits_at: torch.Tensor | None = None,  # [K] long: the only nodes whose outputs are wanted
    head: PassHead | None = None,  # applied to the hidden states returned
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass of `model` over a `TreeCache`'s StaticCache: the mask is built here (so a
    compiled pass builds it inside its graph), the new K/V land at `counts[-2]` onward. Returns the
    logits [B, N, V] and, when asked, the last hidden states [B, N, H] (with a `head`, its outputs
    [B, N, S * D]); with `logits_at`, at those nodes only ([B, K, ...]): the model projects only them
    onto the vocabulary (`logits_to_keep`), which a prompt's pass, whose logits are all dropped but
    the last, spends most on otherwise."""
    rows = tokens.shape[0]
    lengths, start, width = counts[:rows], counts[rows], counts[rows + 1]
    for layer in cache.layers:
        layer.cumulative_length.copy_(start)  # StaticLayer writes its new K/V there
    capacity = cache_capacity(cache)
    mask = tree_attention_mask(
        visible, lengths, width, positions, fed_positions, capacity, model.dtype, layout
    )
    out = model(
        input_ids=tokens,
        position_ids=positions,
        attention_mask=mask,
        use_cache=True,
        **{CACHE_ARGUMENT: cache},
        output_hidden_states=output_hidden,
        **({} if logits_at is None or not keeps_logits(model) else {"logits_to_keep": logits_at}),
    )
    logits, hidden = out.logits, out.hidden_states[-1] if output_hidden else None
    if logits_at is not None:
        logits = logits if logits.shape[1] == len(logits_at) else logits[:, logits_at]
        hidden = None if hidden is None else hidden[:, logits_at]
    return logits, hidden if hidden is None or head is None else apply_head(hidden, head)


class FullStaticCache(StaticCache):
    """transformers' `StaticCache` with every layer a full `StaticLayer`: sliding windows are applied
    by the tree masks (`AttentionLayout`), so that kept K/V can be moved to any position."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        Cache.__init__(self, layers=[StaticLayer(max_cache_len=capacity) for _ in range(num_layers)])
        self.marked = False  # its K/V marked as of dynamic sizes (`CompiledPass.sizes_key`)


def cache_capacity(cache: StaticCache) -> int:
    """The keys `cache` holds per row: read off its K/V tensors once they exist, so that a pass
    compiled with a dynamic capacity (`CompiledPass.sizes_key`) sees the size, not a constant."""
    layer = cache.layers[0]
    return layer.keys.shape[2] if layer.is_initialized else layer.max_cache_len


@dataclass(frozen=True)
class CacheFacts:
    """What a `TreeCache` reads of its model's config, read once per model (`cache_facts`)."""

    layout: AttentionLayout
    num_layers: int
    max_capacity: int  # `max_capacity`


_FACTS: weakref.WeakKeyDictionary[torch.nn.Module, CacheFacts] = weakref.WeakKeyDictionary()


def cache_facts(model: PreTrainedModel) -> CacheFacts:
    """`model`'s `CacheFacts`, read on its first cache and kept while it lives (its config is not
    expected to change while it decodes). A config's attribute reads cost microseconds each, and
    caches are made at every call (a group's, each drafter's, each admission's): a cache cost 53 us
    when each read the config (18 us now), about 0.5 ms of a 48-token generation (27 ms) of the
    learned scheduler at batch 1 on the quick fixture, which makes ten."""
    facts = _FACTS.get(model)
    if facts is None:
        layers = model.config.get_text_config().num_hidden_layers
        facts = _FACTS[model] = CacheFacts(AttentionLayout.of(model), layers, max_capacity(model))
    return facts


@dataclass
class FedOutput:
    logits: torch.Tensor  # [B, N, V] (rows and nodes past the real ones are padding)
    hidden: torch.Tensor | None  # [B, N, H] last-layer hidden states when asked for ([B, N, S * D]: a head's)


class TreeCache:
    """One model's KV cache over a batch of rows of different lengths (see the module doc).
    `compiled` is the model's compiled call, used for passes of up to COMPILED_MAX_NODES nodes."""

    def __init__(
        self, model: PreTrainedModel, rows: int, capacity: int, compiled: CompiledPass | None = None
    ) -> None:
        self.model = model
        self.compiled = compiled
        self.device = model.device
        self.dtype = model.dtype
        facts = cache_facts(model)
        self.layout, self.num_layers, self.max_capacity = facts.layout, facts.num_layers, facts.max_capacity
        self.capacity = capacity
        self.lengths: list[int] = [0] * rows  # committed positions per row (host copy)
        self.pending = 0  # nodes fed since the last commit, in every row
        self._pending_positions: torch.Tensor | None = None  # [B_phys, pending]
        self.cache = FullStaticCache(self.num_layers, capacity)
        # A stacked pool's rows are member blocks (`stack_pool`): padding rows would break them.
        self.pad_rows = getattr(model, "stacked_members", 1) == 1
        self.physical_rows = self._physical(rows)

    def _physical(self, rows: int) -> int:
        """Rows the cache tensors hold: padded to a power of two for a compiled model (a stacked
        pool's are not padded: it compiles a graph per number of rows)."""
        return bucket(rows) if self.compiled is not None and self.pad_rows else max(1, rows)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Where pending nodes start: the longest row's length."""
        return max(self.lengths, default=0)

    def _layers(self) -> list[StaticLayer]:
        return [layer for layer in self.cache.layers if layer.is_initialized]

    # Feeding ---------------------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        """Whether the K/V tensors exist (the first pass allocates them, eagerly)."""
        return all(layer.is_initialized for layer in self.cache.layers)

    @torch.no_grad()
    def feed(
        self,
        tokens: torch.Tensor,  # [B, N] long
        positions: torch.Tensor,  # [B, N] long: each node's position in its row's text
        visible: torch.Tensor,  # [B, N, pending + N] bool: the pending and new nodes each new node sees
        output_hidden: bool = False,
        eager: bool = False,
        logits_at: Sequence[int] | None = None,
    ) -> FedOutput:
        """Feed N nodes per row in ONE pass; they become pending. Every node sees its row's
        committed positions and the nodes marked in `visible` (itself included, ALGORITHMS.md 1).
        Rows and nodes are padded to their buckets; the outputs keep the padding. `logits_at`: the
        outputs at those nodes only, [B, len(logits_at), ...] (an eager pass computes no others).
        A pass whose padding alone would not fit runs eagerly: growing the cache for padding made
        a capacity no warm-up had met, where every expected pass then compiled (a routed chain of
        7 nodes, padded to 8, 2 positions before a text's end: 11 graphs, 64 s in a timed run)."""
        b, n = tokens.shape
        if b != self.rows:
            raise ValueError(f"{b} rows of nodes for a cache of {self.rows} rows")
        start = self.width + self.pending
        compiled = (
            self.compiled is not None
            and not eager
            and node_bucket(n) <= COMPILED_MAX_NODES
            and self.initialized
            and not start + n <= self.capacity < start + node_bucket(n)
        )
        rows, nodes = self.physical_rows, node_bucket(n) if compiled else n
        keys = node_bucket(self.pending + nodes) if compiled else self.pending + nodes
        if start + nodes > self.capacity:
            self._grow(start + nodes)
        if compiled:
            self._warm()
        tokens, positions, visible = _pad(tokens, positions, visible, rows, nodes, self.pending, keys)
        fed = (
            positions
            if self._pending_positions is None
            else torch.cat([self._pending_positions, positions], 1)
        )  # [rows, pending + nodes]
        counts = self._counts(rows, start)
        inputs = (tokens, positions, visible, _pad_keys(fed, keys), counts, self.layout, self.dtype)
        kept = None if logits_at is None else torch.tensor(logits_at, device=self.device)
        if compiled:
            logits, hidden = self.compiled(self.model, self.cache, *inputs, output_hidden)
            if kept is not None:
                logits, hidden = logits[:, kept], None if hidden is None else hidden[:, kept]
        else:
            head = None if self.compiled is None else self.compiled.head_for(output_hidden)
            logits, hidden = tree_pass(self.model, self.cache, *inputs, output_hidden, kept, head)
        self._pending_positions = fed
        self.pending += nodes
        n = n if kept is None else len(kept)
        return FedOutput(logits[:b, :n], None if hidden is None else hidden[:b, :n])

    @torch.no_grad()
    def warm_for(self, positions: int) -> None:
        """A compiled cache: grow now to hold `positions` per row, and have every expected pass
        compiled at its rows and capacity (`_warm`). A cache whose growth follows the text, not the
        passes it happens to run, meets the same shapes whichever passes it runs: the routed
        scheduler's drafters (ALGORITHMS.md 5.3) draft on the steps their SSM is chosen, which
        differ between a warm-up and a timed run of the same prompts. It runs every step for every
        drafter, so where its rows and capacity were met (a timed run after its warm-up) it only
        compares numbers: no K/V allocation pass (an eager pass that its first real pass makes
        anyway). An eager cache: nothing (it grows when a pass needs it)."""
        if self.compiled is None or not self.rows:
            return
        positions = min(positions, self.max_capacity)
        if positions > self.capacity:
            self._grow(positions)
        if (self.physical_rows, self.capacity) in self.compiled.met:
            return
        if not self.initialized:  # allocate the K/V tensors with one eager pass, as a first pass does
            self._dummy_pass(
                tree_pass, 1, 1, False, self._counts(self.physical_rows, self.width + self.pending)
            )
        self._warm()

    def _warm(self) -> None:
        """Compile the compiled call's expected shapes at this cache's rows and capacity, the first
        time any cache of them meets it (`CompiledPass`), and at every smaller row bucket of that
        capacity: a group shrinks through the buckets as its rows finish, but one step may finish
        several rows and skip a bucket, so a warm-up run and a timed one of the same prompts, routed
        differently, met different buckets (the quick suite had compiled 9-10 graphs in timed runs at
        batch 8). The passes write their K/V past the fed nodes, where the next pass writes its own;
        a shape that would not fit is skipped (such a pass grows the cache first)."""
        call = self.compiled
        if (self.physical_rows, self.capacity) in call.met:
            return
        self._run_expected(self.width + self.pending)
        rows = self.physical_rows // 2 if self.pad_rows else 0
        while rows >= 1 and self.initialized:
            if (rows, self.capacity) not in call.met:
                scratch = TreeCache(self.model, rows, self.capacity, call)
                for layer, like in zip(scratch.cache.layers, self.cache.layers, strict=True):
                    _allocate(layer, like, rows)
                scratch._run_expected(0)
            rows //= 2

    def _run_expected(self, start: int) -> None:
        """Run every expected shape of the compiled call at this cache's rows and capacity, writing
        past `start` (the fed nodes)."""
        call, rows = self.compiled, self.physical_rows
        call.met.add((rows, self.capacity))
        _Setup.events += 1
        counts = self._counts(rows, start)
        for nodes, keys, hidden in sorted(call.expected):
            if start + nodes <= self.capacity:
                self._dummy_pass(call, nodes, keys, hidden, counts)
        if rows == 1:  # chain blocks serve one-row caches (`feed_argmax`, `feed_sampled`)
            token = torch.zeros(1, dtype=torch.long, device=self.device)
            for steps in sorted(call.expected_chains):
                if start + steps <= self.capacity:
                    self._chain_pass(token, start, steps)
                    for top_k, nucleus in sorted(call.expected_draws):
                        warp = ChainWarp(top_k=top_k, top_p=0.5 if nucleus else 1.0).arguments(1, self.device)
                        self._chain_pass(
                            token, start, steps, (warp, torch.zeros(1, steps, device=self.device))
                        )

    def _dummy_pass(
        self, run: Callable[..., object], nodes: int, keys: int, hidden: bool, counts: torch.Tensor
    ) -> None:
        """A pass of `nodes` nodes seeing `keys` fed ones whose K/V land past the fed nodes (where the
        next real pass writes its own), with inputs like a real pass's: distinct, contiguous tensors
        (the graphs guard on both)."""
        rows = self.physical_rows
        tokens = torch.zeros(rows, nodes, dtype=torch.long, device=self.device)
        positions = torch.zeros_like(tokens)
        visible = torch.eye(nodes, keys, dtype=torch.bool, device=self.device).repeat(rows, 1, 1)
        fed = torch.zeros(rows, keys, dtype=torch.long, device=self.device)
        run(self.model, self.cache, tokens, positions, visible, fed, counts, self.layout, self.dtype, hidden)

    def _counts(self, rows: int, start: int) -> torch.Tensor:
        """[rows + 2] a pass's `counts`: row lengths (padding rows: 0), where the new K/V are
        written, where the fed nodes start."""
        return torch.tensor([*self.lengths, *[0] * (rows - self.rows), start, self.width], device=self.device)

    def feed_chains(
        self,
        chains: Sequence[Sequence[int]],
        eager: bool = False,
        commit: bool = True,
        output_hidden: bool = False,
        every: bool = False,
    ) -> FedOutput:
        """Append chain `chains[b]` to row b's text (a prompt, tokens verified since the row's last
        pass) in ONE pass and commit it (or leave it pending); the logits [B, V] (and last hidden
        states [B, H]) after each row's last token (garbage for a row fed nothing), or with `every`
        after each of its tokens, [B, N, ...] (padding past a row's chain). No pending nodes may be
        in flight. A compiled cache feeds chains longer than its room after the widest row in parts
        (`_feed_in_parts`) rather than grow; not with `every` (`in_parts` says where it would)."""
        assert self.pending == 0, "commit the pending nodes first"
        n = max(1, max(map(len, chains), default=0))
        if commit and self.in_parts(n):
            if every:
                raise ValueError(f"chains of {n} tokens do not fit this cache in one pass")
            return self._feed_in_parts(chains, output_hidden)
        tokens = torch.tensor([[*chain, *[0] * (n - len(chain))] for chain in chains], device=self.device)
        sizes = torch.tensor([len(c) for c in chains], device=self.device)
        step = torch.arange(n, device=self.device)
        valid = step[None] < sizes[:, None]  # [B, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        eye = torch.eye(n, dtype=torch.bool, device=self.device)
        visible = torch.where(valid[:, :, None], causal & valid[:, None, :], eye)  # padding: itself only
        positions = torch.tensor(self.lengths, device=self.device)[:, None] + step
        last = [max(1, len(chain)) - 1 for chain in chains]
        kept = list(range(n)) if every else sorted(set(last))
        eager = eager or n > COMPILED_MAX_CHAIN
        out = self.feed(tokens, positions, visible, output_hidden, eager, logits_at=kept)
        if commit:
            self.commit([range(len(chain)) for chain in chains])
        if every:
            return out
        rows = torch.arange(self.rows, device=self.device)
        columns = torch.tensor([kept.index(i) for i in last], device=self.device)
        return FedOutput(out.logits[rows, columns], None if out.hidden is None else out.hidden[rows, columns])

    def in_parts(self, n: int) -> bool:
        """Whether `feed_chains` feeds chains of up to `n` tokens in parts: a compiled cache
        without their room after its widest row."""
        return self.compiled is not None and 0 < self.capacity - self.width < n

    def _feed_in_parts(self, chains: Sequence[Sequence[int]], output_hidden: bool) -> FedOutput:
        """`feed_chains` of chains that do not fit after the widest row, in parts that do, each
        committed before the next; each row's outputs from the part that held its last token.
        Fed nodes sit after the widest row and move to their row's place at the commit, so one pass
        of a row far behind needs about twice its text's room: an SSM's catch-up after a stretch
        of plain steps (ALGORITHMS.md 5.4) grew a drafter's cache to a capacity no warm-up had met,
        and every expected pass compiled inside a timed run (the quick suite's batch-8 engine: 28
        graphs, 33-129 s). A row's text still never outgrows the capacity its warm-up set."""
        rest = [list(chain) for chain in chains]
        logits: torch.Tensor | None = None
        hidden: torch.Tensor | None = None
        while any(rest):
            room = max(1, self.capacity - self.width)
            part, rest = [chain[:room] for chain in rest], [chain[room:] for chain in rest]
            out = self.feed_chains(part, eager=True, output_hidden=output_hidden)
            ends = torch.tensor(
                [bool(p) and not r for p, r in zip(part, rest, strict=True)], device=self.device
            )
            logits = out.logits if logits is None else torch.where(ends[:, None], out.logits, logits)
            if out.hidden is not None:
                hidden = out.hidden if hidden is None else torch.where(ends[:, None], out.hidden, hidden)
        assert logits is not None
        return FedOutput(logits, hidden)

    def feed_column(self, tokens: torch.Tensor, active: Sequence[bool]) -> torch.Tensor:
        """Append one token per active row (`tokens` [B], on the device: nothing is read back) and
        commit it; [B, V] logits after it (garbage for inactive rows, which are fed padding)."""
        assert self.pending == 0, "commit the pending nodes first"
        b = self.rows
        on = torch.tensor(list(active), device=self.device)
        positions = torch.tensor(self.lengths, device=self.device)[:, None]
        visible = torch.ones(b, 1, 1, dtype=torch.bool, device=self.device)
        out = self.feed((tokens * on)[:, None], positions, visible)
        self.commit([[0] if a else [] for a in active])
        return out.logits[:, 0]

    def feed_argmax(self, token: torch.Tensor, feeds: int) -> torch.Tensor:
        """Feed `token` [B] (on the device), then `feeds` - 1 times the argmax of the logits after
        the token fed last, every row, each committed; the `feeds` argmax tokens, [B, feeds] (the
        last one not fed): a greedy chain's drafting after its first token. A one-row compiled
        cache feeds them in the compiled blocks its call expects (`CHAIN_BLOCKS`, largest first;
        speculator/chain_block.py), the rest one `feed_column` each."""
        return self._feed_drawn(token, feeds)[0]

    def feed_sampled(
        self, token: torch.Tensor, warp: ChainWarp, uniform: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`feed_argmax` of a sampled chain: each token after `token` drawn from q, the model's
        probabilities under `warp`, at the caller's uniform numbers `uniform` [B, feeds]
        (`sampling.inverse_cdf`); the `feeds` drawn tokens [B, feeds] and their q [B, feeds, V].
        A one-row compiled cache feeds them in the sampled blocks of its call's expected sizes
        (speculator/chain_block.py) where its call expects this warp (`CompiledPass.expect_draws`:
        a decoder that never samples compiles none), the rest one pass a token."""
        return self._feed_drawn(token, uniform.shape[1], warp, uniform)  # type: ignore[return-value]

    def _feed_drawn(
        self,
        token: torch.Tensor,
        feeds: int,
        warp: ChainWarp | None = None,
        uniform: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`feed_argmax` (no `warp`) or `feed_sampled`: the tokens, and their q where sampled."""
        chosen = torch.empty(self.rows, feeds, dtype=torch.long, device=self.device)
        qs: list[torch.Tensor] = []
        setting = None if warp is None else warp.arguments(self.rows, self.device)
        done = 0
        while done < feeds:
            block = self._chain_block(feeds - done, None if warp is None else warp.key)
            draws = None if setting is None else (setting, uniform[:, done : done + block])
            out = None if not block else self._chain_pass(token, self.width, block, draws)
            if out is None:
                block, logits = 1, self.feed_column(token, [True] * self.rows)
                if setting is None:
                    out = logits.float().argmax(-1)[:, None]
                else:
                    q = warped_probs(logits, *setting)
                    out = inverse_cdf(q, uniform[:, done : done + 1]), q[:, None]
            else:
                self.lengths = [length + block for length in self.lengths]
            if setting is not None:
                out, q = out
                qs.append(q)
            chosen[:, done : done + block] = out
            token = chosen[:, done + block - 1]
            done += block
        return chosen, torch.cat(qs, 1) if qs else None

    def _chain_block(self, feeds: int, warp: tuple[int, bool] | None = None) -> int:
        """The largest chain block of at most `feeds` tokens (argmax, or sampled under a
        `ChainWarp.key`) this cache can feed now (0: none): a compiled one-row cache with no pending
        nodes and room for the block, whose call compiled the block at this capacity when the cache
        warmed (`_run_expected`): none compiles here."""
        call = self.compiled
        if call is None or self.physical_rows != 1 or self.rows != 1 or self.pending:
            return 0
        most = min(feeds, self.capacity - self.width)
        made = call.store.functions
        blocks = (
            b for b in call.expected_chains if b <= most and call.chain_key(self.cache, 1, b, warp) in made
        )
        return max(blocks, default=0)

    def _chain_pass(
        self, token: torch.Tensor, start: int, steps: int, draws: Draws | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """The compiled block of `steps` argmax tokens after `token` [1] (with `draws`: sampled
        tokens and their q), fed from position `start` (the row's length); None if the call makes
        none. Inputs like a real pass's: distinct, contiguous tensors (the graphs guard on both).
        `token` and the draws' uniform numbers are copied to strides of their own: a chain's column
        (and a block's slice of the chain's numbers) keeps the chain's width as its stride (even
        `clone` keeps it), and a graph compiled for one width recompiled for every other the router
        drafted (a sampled block recompiled inside a timed run of the T = 0.8 suite, 3-4 s)."""
        assert self.compiled is not None
        counts = torch.tensor([start, start, start], device=self.device)
        positions = torch.tensor([[start]], device=self.device)
        visible = torch.ones(1, 1, 1, dtype=torch.bool, device=self.device)
        token = token.clone(memory_format=torch.contiguous_format)
        if draws is not None:
            draws = draws[0], draws[1].clone(memory_format=torch.contiguous_format)
        return self.compiled.chain(
            self.model, self.cache, token, positions, visible, counts, self.layout, self.dtype, steps, draws
        )

    def commit(self, keep: Sequence[Sequence[int]]) -> None:
        """Row b appends the pending nodes `keep[b]` (indices in feeding order), in that order;
        every other pending node is dropped."""
        if len(keep) != self.rows:
            raise ValueError(f"{len(keep)} kept-node lists for a cache of {self.rows} rows")
        width = self.width
        rows, sources, targets = [], [], []
        for row, (length, kept) in enumerate(zip(self.lengths, keep, strict=True)):
            for i, node in enumerate(kept):
                assert 0 <= node < self.pending, "kept node was not fed"
                if width + node != length + i:
                    rows.append(row)
                    sources.append(width + node)
                    targets.append(length + i)
        if rows:  # gather first: targets may overlap sources
            index = [torch.tensor(x, device=self.device) for x in (rows, sources, targets)]
            for layer in self._layers():
                layer.keys[index[0], :, index[2]] = layer.keys[index[0], :, index[1]]
                layer.values[index[0], :, index[2]] = layer.values[index[0], :, index[1]]
        self.lengths = [length + len(kept) for length, kept in zip(self.lengths, keep, strict=True)]
        self.pending = 0
        self._pending_positions = None

    # Rows -------------------------------------------------------------------------------------------
    def truncate(self, row: int, length: int) -> None:
        """Forget row `row`'s positions from `length` on (no pending nodes may be in flight)."""
        assert self.pending == 0 and 0 <= length <= self.lengths[row]
        self.lengths[row] = length

    def select(self, rows: Sequence[int]) -> None:
        """Keep only the rows `rows`, in that order (a row may repeat); pending nodes stay pending."""
        positions = self._pending_positions
        self._rebuild([(self, list(rows))])
        if positions is not None:
            index = torch.tensor(list(rows), device=self.device)
            self._pending_positions = positions.new_zeros(self.physical_rows, positions.shape[1])
            self._pending_positions[: len(rows)] = positions[index]

    def extend(self, other: TreeCache) -> None:
        """Append the rows of `other` (of the same model) after this cache's rows."""
        assert self.pending == 0 and other.pending == 0
        self._rebuild([(self, list(range(self.rows))), (other, list(range(other.rows)))])

    def _grow(self, needed: int) -> None:
        """Reallocate to a capacity holding `needed` positions (rows, lengths and pending nodes kept)."""
        if needed > self.max_capacity:
            raise ValueError(
                f"{needed - self.width} tree nodes after {self.width} cached positions exceed the cache's "
                f"capacity limit of {self.max_capacity} positions: draft smaller trees"
            )
        _Setup.events += 1
        old, self.capacity = self.cache, capacity_for(needed)
        self.cache = FullStaticCache(self.num_layers, self.capacity)
        used = self.width + self.pending
        for new, layer in zip(self.cache.layers, old.layers, strict=True):
            if layer.is_initialized:
                _allocate(new, layer, self.physical_rows)
                new.keys[:, :, :used] = layer.keys[:, :, :used]
                new.values[:, :, :used] = layer.values[:, :, :used]

    def _rebuild(self, parts: list[tuple[TreeCache, list[int]]]) -> None:
        """This cache becomes the rows `parts` name, copied out of their caches in that order."""
        self.compiled = self.compiled or next((p.compiled for p, _ in parts if p.compiled is not None), None)
        lengths = [part.lengths[r] for part, rows in parts for r in rows]
        # The capacity of the caches that give rows: an empty cache's (a group's before its first
        # rows came) would otherwise set every later pass's attention span.
        capacity = max((part.capacity for part, rows in parts if rows), default=self.capacity)
        physical = self._physical(len(lengths))
        cache = FullStaticCache(self.num_layers, capacity)
        template = next(
            (p.cache.layers for p, _ in parts if any(x.is_initialized for x in p.cache.layers)), None
        )
        if template is not None:
            for i, layer in enumerate(cache.layers):
                _allocate(layer, template[i], physical)
                start = 0
                for part, rows in parts:
                    source = part.cache.layers[i]
                    if rows and source.is_initialized:
                        index = torch.tensor(rows, device=self.device)
                        span = source.keys.shape[2]
                        layer.keys[start : start + len(rows), :, :span] = source.keys[index]
                        layer.values[start : start + len(rows), :, :span] = source.values[index]
                    start += len(rows)
        self.cache, self.capacity, self.lengths, self.physical_rows = cache, capacity, lengths, physical


def _allocate(layer: StaticLayer, like: StaticLayer, rows: int) -> None:
    """Give `layer` zero K/V tensors of `rows` rows, shaped and typed like `like`'s."""
    shape_k = (rows, like.keys.shape[1], layer.max_cache_len, like.keys.shape[3])
    shape_v = (rows, like.values.shape[1], layer.max_cache_len, like.values.shape[3])
    layer.keys = like.keys.new_zeros(shape_k)
    layer.values = like.values.new_zeros(shape_v)
    torch._dynamo.mark_static_address(layer.keys)  # CUDA graphs read the cache in place, never copy it
    torch._dynamo.mark_static_address(layer.values)
    # From the tensors: transformers 5.24 dropped the layers' own `dtype` (earlier ones read it).
    layer.dtype, layer.device = like.keys.dtype, like.keys.device
    layer.batch_size, layer.num_heads = rows, like.num_heads
    layer.k_head_dim, layer.v_head_dim = like.k_head_dim, like.v_head_dim
    layer.cumulative_length = layer.cumulative_length.to(like.device)
    torch._dynamo.mark_static_address(layer.cumulative_length)
    layer.is_initialized = True


def _pad_keys(fed: torch.Tensor, keys: int) -> torch.Tensor:
    """The fed nodes' positions [rows, pending + nodes] padded to `keys` columns (keys no node sees)."""
    if fed.shape[1] == keys:
        return fed
    return torch.cat([fed, fed.new_zeros(fed.shape[0], keys - fed.shape[1])], 1)


def _pad(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    visible: torch.Tensor,
    rows: int,
    nodes: int,
    pending: int,
    keys: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad rows to `rows`, nodes to `nodes` (a padding node sees only itself) and the fed nodes seen
    to `keys` (a padding key is seen by none)."""
    b, n = tokens.shape
    if (b, n, visible.shape[2]) == (rows, nodes, keys):
        return tokens, positions, visible
    device = tokens.device
    padded_tokens = tokens.new_zeros(rows, nodes)
    padded_tokens[:b, :n] = tokens
    padded_positions = positions.new_zeros(rows, nodes)
    padded_positions[:b, :n] = positions
    padded_positions[:b, n:] = positions[:, -1:]
    padded_visible = torch.zeros(rows, nodes, keys, dtype=torch.bool, device=device)
    padded_visible[:, :, pending : pending + nodes] = torch.eye(nodes, dtype=torch.bool, device=device)
    padded_visible[:b, :n, : pending + n] = visible
    return padded_tokens, padded_positions, padded_visible
