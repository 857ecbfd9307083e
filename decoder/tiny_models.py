"""Tiny stand-in models for the example, the CLI tests and the single-file bench (`make bench-decoder`).

    python -m specboost.decoder.tiny_models --out artifacts/tiny-models [--seed 0] [--force]

writes `OUT/llm`, `OUT/ssm-0` and `OUT/ssm-1`, each a Llama-architecture causal LM saved with
`save_pretrained` together with one shared byte-level tokenizer, so that all three load with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` from disk.

These are STAND-INS with random weights, until the project trains a real reference LLM and
distils SSMs from it (a later issue). Random models rarely agree, so they are built to agree
often enough for speculation to be visible:

- the LLM's residual stream is dominated by the token embedding (attention and MLP output
  projections start tiny), so it behaves like a noisy bigram model with a little context;
- each SSM is a layer-truncated copy of the LLM (embedding, first layers, final norm, lm_head)
  plus a small random perturbation, so its predictions mostly but not always match;
- the LLM's lm_head rows of the special tokens are zero: a logit of 0 never wins the argmax over
  256 random byte logits, so greedy decoding does not stop at EOS and every run generates exactly
  `max_new_tokens` tokens (handy for benchmarks).

The generated text is gibberish; only speed, acceptance and exactness are meaningful.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0..3; the 256 bytes follow
MANIFEST = "tiny_models.json"  # the TinyModelsConfig the folder was built with


@dataclass(frozen=True)
class TinyModelsConfig:
    hidden_size: int = 128
    intermediate_size: int = 256
    llm_layers: int = 4
    ssm_layers: tuple[int, ...] = (1, 2)  # layers kept by each SSM (one SSM per entry)
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    embedding_std: float = 1.0  # large: the embedding dominates the residual stream
    residual_std: float = 0.05  # std of attention/MLP output projections (the context's influence)
    lm_head_std: float = 0.25  # logits of std ~ 0.25 * sqrt(hidden_size): peaky distributions
    ssm_noise_std: float = 0.1  # perturbation added to every SSM weight, relative to the weight's std
    seed: int = 0

    def __post_init__(self) -> None:
        if any(not 1 <= n <= self.llm_layers for n in self.ssm_layers):
            raise ValueError(f"every SSM keeps 1..{self.llm_layers} layers, got {self.ssm_layers}")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges: one token per UTF-8 byte, plus 4 special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(sorted(alphabet))})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return fast_tokenizer(tokenizer)


def fast_tokenizer(tokenizer: Tokenizer, **kwargs: object) -> PreTrainedTokenizerFast:
    """A `tokenizers` tokenizer as a transformers tokenizer, with SPECIAL_TOKENS in their roles."""
    pad, bos, eos, unk = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk, **kwargs
    )


def build_llm(config: TinyModelsConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    with torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's RNG state
        torch.manual_seed(config.seed)
        return _build_llm(config, tokenizer)


def _build_llm(config: TinyModelsConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.llm_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(model_config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, config.embedding_std)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.normal_(0.0, config.residual_std)
            layer.mlp.down_proj.weight.normal_(0.0, config.residual_std)
        model.lm_head.weight.normal_(0.0, config.lm_head_std)
        model.lm_head.weight[: len(SPECIAL_TOKENS)] = 0.0  # logit 0 never wins an argmax over 256 bytes
    model.generation_config = GenerationConfig(
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model


def build_ssm(llm: LlamaForCausalLM, layers: int, noise_std: float, seed: int) -> LlamaForCausalLM:
    """The LLM cut to its first `layers` layers, every weight perturbed by relative noise."""
    config = copy.deepcopy(llm.config)
    config.num_hidden_layers = layers
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten below anyway
        ssm = LlamaForCausalLM(config)
    # Layers beyond `layers` have no place in the SSM; everything else is copied.
    ssm.load_state_dict({k: v for k, v in llm.state_dict().items() if k in ssm.state_dict()})
    ssm.generation_config = copy.deepcopy(llm.generation_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in ssm.parameters():
            scale = param.std() if param.numel() > 1 and param.std() > 0 else param.abs().mean()
            param.add_(torch.randn(param.shape, generator=generator) * noise_std * scale)
    return ssm.eval()


PRESETS = {
    # tests and the README example: builds in well under a second
    "tiny": TinyModelsConfig(),
    # the single-file bench: an LLM big enough that one of its passes costs several SSM passes
    "bench": TinyModelsConfig(
        hidden_size=512,
        intermediate_size=1536,
        llm_layers=12,
        ssm_layers=(1, 2),
        num_attention_heads=8,
        num_key_value_heads=4,
        residual_std=0.015,  # ~0.05 * sqrt(128 / 512) * sqrt(4 / 12): as much context as the tiny preset,
    ),
}


def _built_with(out: Path) -> dict | None:
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def build_tiny_models(
    out: str | Path, config: TinyModelsConfig | None = None, force: bool = False
) -> tuple[Path, list[Path]]:
    """Build and save the tiny LLM, its SSMs and the tokenizer under `out` as `llm/`, `ssm-0/`,
    `ssm-1/`...; skipped when `out` already holds models built with the same config, unless
    `force`. Returns the LLM folder and the SSM folders."""
    config = config or TinyModelsConfig()
    out = Path(out)
    llm_dir, ssm_dirs = out / "llm", [out / f"ssm-{i}" for i in range(len(config.ssm_layers))]
    manifest = json.loads(json.dumps(asdict(config)))  # tuples as lists, as read back
    if not force and _built_with(out) == manifest:
        return llm_dir, ssm_dirs
    tokenizer = build_tokenizer()
    llm = build_llm(config, tokenizer)
    models_to_save = [llm] + [
        build_ssm(llm, layers, config.ssm_noise_std, config.seed + 1 + i)
        for i, layers in enumerate(config.ssm_layers)
    ]
    for model, folder in zip(models_to_save, (llm_dir, *ssm_dirs), strict=True):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks a complete build
    return llm_dir, ssm_dirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specboost.decoder.tiny_models",
        description="Build a tiny random Llama 'LLM', two SSMs cut from it, and a byte-level tokenizer "
        "(stand-ins until a real reference LLM is trained).",
    )
    parser.add_argument("--out", required=True, type=Path, help="folder to write llm/, ssm-0/, ssm-1/ into")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights (default: 0)")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="model sizes: 'tiny' (tests, example) or 'bench' (12-layer LLM, for timing) (default: tiny)",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if OUT holds models built with the same settings"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    llm_dir, ssm_dirs = build_tiny_models(
        args.out, dataclasses.replace(PRESETS[args.preset], seed=args.seed), force=args.force
    )
    print(f"tiny models in {args.out} ({time.perf_counter() - start:.1f} s): {llm_dir.name}, ", end="")
    print(", ".join(d.name for d in ssm_dirs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
