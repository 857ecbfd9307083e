"""The architecture matrix: greedy decoding equals `llm.generate` on tiny random models of the
common open families, for chains, beam trees, fixed topologies, Stairs validation and a batch
(float64), including
sliding-window attention (Mistral, Qwen2 with `use_sliding_window`, Gemma 2/3 with interleaved
local and global layers, Phi-3), where the window is small enough to bind. Attention that tree
attention cannot express (ALiBi: BLOOM) is refused at construction, naming the model type.

When the LLM drafts for itself, every drafted token must be accepted: that checks the SSM side's
tree attention (windows included), which lossless verification alone would hide.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import noisy_copy
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specboost.decoder import BeamShape, ChainShape, SpeculativeDecoder, TopologyShape
from specboost.speculator.attention_layout import AttentionLayout
from specboost.speculator.kv_cache import TreeCache
from specboost.speculator.tree import TokenTree, TreeBatch

VOCAB = 64
WINDOW = 5  # binds: prompts of 9 tokens + 20 new ones
NEW = 20


def _config(model_type: str, **overrides: object) -> AutoConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
    )
    return AutoConfig.for_model(model_type, **(base | overrides))


CONFIGS = {
    "llama": lambda: _config("llama"),
    "qwen2": lambda: _config("qwen2"),
    "qwen2-sliding": lambda: _config(
        "qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, num_hidden_layers=3
    ),
    "mistral": lambda: _config("mistral", sliding_window=WINDOW),
    "gemma": lambda: _config("gemma", head_dim=8),
    "gemma2": lambda: _config("gemma2", head_dim=8, sliding_window=WINDOW, num_hidden_layers=4),
    "gemma3": lambda: _config(
        "gemma3_text",
        head_dim=8,
        sliding_window=WINDOW,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "phi3": lambda: _config("phi3", sliding_window=WINDOW, pad_token_id=0),
    "gpt2": lambda: AutoConfig.for_model(
        "gpt2",
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=None,
    ),
    "gpt_neox": lambda: _config("gpt_neox", num_key_value_heads=None),
    "opt": lambda: AutoConfig.for_model(
        "opt",
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=32,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=1,
    ),
    "falcon": lambda: _config("falcon", num_kv_heads=2, new_decoder_architecture=True),
    "stablelm": lambda: _config("stablelm"),
}
SLIDING = {"qwen2-sliding": 2, "mistral": 1, "gemma2": 2, "gemma3": 2, "phi3": 1}  # -> number of mask kinds
ARCHS = sorted(CONFIGS)
SHAPES = {
    "chain": ChainShape(4),
    "beam": BeamShape(2, 3),
    "topology": TopologyShape.from_children_counts([[2], [2, 1], [1, 0, 0]]),
}
PROMPTS = [[3, 17, 42, 8, 8, 51, 23, 9, 30], [12, 5, 60]]


@functools.cache
def models(arch: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    torch.manual_seed(0)
    llm = AutoModelForCausalLM.from_config(CONFIGS[arch]()).double().eval()
    return llm, noisy_copy(llm, scale=0.2, seed=1)


@functools.cache
def reference(arch: str, prompt: tuple[int, ...]) -> list[int]:
    ids = torch.tensor([prompt])
    out = models(arch)[0].generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW
    )
    return out[0].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_is_read_from_the_config(arch: str) -> None:
    layout = AttentionLayout.of(models(arch)[0])
    if arch in SLIDING:
        assert layout.window == WINDOW and len(layout.types) == SLIDING[arch]
        assert layout.per_type == (SLIDING[arch] > 1)
    else:
        assert layout.window is None


@pytest.mark.parametrize("shape", [*sorted(SHAPES), "stairs"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate(arch: str, shape: str) -> None:
    llm, ssm = models(arch)
    if shape == "stairs":
        dec = SpeculativeDecoder(llm, [ssm], shape=ChainShape(3), verification="stairs")
    else:
        dec = SpeculativeDecoder(llm, [ssm], shape=SHAPES[shape])
    for prompt in PROMPTS:
        out = dec.generate(torch.tensor([prompt]), max_new_tokens=NEW)
        assert out.sequences[0].tolist() == reference(arch, tuple(prompt)), f"{arch} {shape} differs"


@pytest.mark.parametrize("arch", ARCHS)
def test_self_drafting_is_always_accepted_and_batches_equal_generate(arch: str) -> None:
    llm, ssm = models(arch)
    out = SpeculativeDecoder(llm, [llm], shape=ChainShape(4)).generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=NEW
    )
    assert out.sequences[0].tolist() == reference(arch, tuple(PROMPTS[0]))
    assert out.stats.acceptance_rate == 1.0, f"{arch}: the SSM side's attention differs from the LLM's"
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    batch = SpeculativeDecoder(llm, [ssm], shape=ChainShape(3)).generate(
        ids, attention_mask=mask, max_new_tokens=NEW
    )
    for row, prompt in enumerate(PROMPTS):
        assert batch.sequences[row, width:].tolist() == reference(arch, tuple(prompt))[len(prompt) :]


@pytest.mark.parametrize("arch", sorted(SLIDING))
def test_one_tree_pass_equals_every_path_past_the_window(arch: str) -> None:
    """Tree logits after a prefix longer than the window equal plain causal passes of each path."""
    llm, _ = models(arch)
    prefix = PROMPTS[0] + PROMPTS[1]
    tree = TokenTree.root_only(prefix[-1])
    for path in ([4, 7, 9, 2], [4, 11], [13, 7, 7]):
        tree.add_sequence(path, 0)
    cache = TreeCache(llm, 1, 128)
    batch = TreeBatch.pack([tree])
    with torch.no_grad():
        cache.feed_chains([prefix[:-1]])
        logits = cache.feed(batch.tokens, cache.lengths[0] + batch.depths, batch.ancestors).logits[0]
        for u in range(len(tree)):
            path = prefix + [tree.tokens[v] for v in tree.path_to(u)]
            expected = llm(torch.tensor([path])).logits[0, -1]
            torch.testing.assert_close(logits[u], expected, rtol=1e-6, atol=1e-6)  # Gemma norms in float32


def test_alibi_models_are_refused_at_construction() -> None:
    config = AutoConfig.for_model("bloom", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    bloom = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(NotImplementedError, match="bloom uses ALiBi"):
        SpeculativeDecoder(bloom, [bloom])
    llm, _ = models("llama")
    with pytest.raises(NotImplementedError, match=r"the SSM 0 .*bloom uses ALiBi"):
        SpeculativeDecoder(llm, [bloom])


def test_layer_types_tree_attention_cannot_mask_are_refused() -> None:
    llm, _ = models("gemma2")
    config = llm.config
    original = list(config.layer_types)
    config.layer_types = ["chunked_attention", "full_attention", "sliding_attention", "full_attention"]
    try:
        with pytest.raises(NotImplementedError, match="chunked_attention"):
            SpeculativeDecoder(llm, [llm])
    finally:
        config.layer_types = original
