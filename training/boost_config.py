"""The settings of a boost run (`BoostConfig`, training/boost.py): the values each may take, and
which of them a resumed run must share."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from specboost.training.distribution_loss import LOSSES

MARKINGS = ("sample", "span")
BOOST_MODES = ("greedy", "sampled", "specialists")
# what specialist boosting clusters to start its EM from (training/specialists.py, ALGORITHMS.md 4.1)
EM_FEATURES = ("sif", "prompt-mean")
EM_FIELDS = ("em_rounds", "em_feature", "min_share", "em_span")  # settings of specialists mode only
SSM_PRESETS = {"tenth": 0.1, "fifth": 0.2, "twentieth": 0.05}  # SSM parameters / LLM parameters


@dataclass(frozen=True)
class BoostConfig:
    distilled: str = field(metadata={"help": "distill run folder (data.parquet)"})
    llm: str = field(metadata={"help": "the LLM folder or id: its tokenizer and config"})
    num_ssms: int = 3  # may grow between resumes
    ssm_base: str | None = None  # small HF causal LM to start every SSM from (None: a fresh config)
    ssm_config: str = "tenth"  # SSM_PRESETS key, used when ssm_base is None
    marking: str = "sample"  # "sample" (SpecInfer) or "span"; greedy boost mode only
    span_depth: int = 4  # d of span marking
    boost_mode: str = "greedy"  # "greedy" (marking, section 4), "sampled" (acceptance weights,
    # section 15) or "specialists" (hard EM on acceptance, section 4.1)
    loss: str = "ce"  # "ce" (the LLM's tokens), "kl" / "tv" (its stored distributions), "mix" (ce + kl)
    mix_weight: float = 1.0  # w of loss "mix" = CE + w KL
    chain: int = 4  # greedy chain length scored on the held-out split
    held_out_fraction: float = 0.1
    seed: int = 0
    # specialists mode (section 4.1): EM rounds, the clustering feature it starts from, the least
    # share of the units a member keeps, as a fraction of 1 / num_ssms, and what a unit is: a
    # whole sample (0) or a span of em_span output positions of one
    em_rounds: int = 2
    em_feature: str = "sif"
    min_share: float = 0.5
    em_span: int = 0
    # training (per round)
    epochs: float = 3.0
    max_steps: int = -1  # > 0 overrides epochs
    batch_size: int = 8
    grad_accum_steps: int = 1
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    save_steps: int = 50
    logging_steps: int = 10
    lora: bool = False  # train LoRA adapters (merged into the weights before saving)
    lora_rank: int = 16
    lora_alpha: int = 32
    eval_batch_size: int = 16

    def __post_init__(self) -> None:
        if self.marking not in MARKINGS:
            raise ValueError(f"marking must be one of {', '.join(MARKINGS)}, got {self.marking!r}")
        if self.boost_mode not in BOOST_MODES:
            raise ValueError(f"boost_mode must be one of {', '.join(BOOST_MODES)}, got {self.boost_mode!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not self.mix_weight >= 0:
            raise ValueError(f"mix_weight must be >= 0, got {self.mix_weight}")
        if self.ssm_base is None and self.ssm_config not in SSM_PRESETS:
            raise ValueError(f"ssm_config must be one of {', '.join(SSM_PRESETS)}, got {self.ssm_config!r}")
        if min(self.num_ssms, self.span_depth, self.chain, self.batch_size, self.grad_accum_steps) < 1:
            raise ValueError("num_ssms, span_depth, chain, batch_size and grad_accum_steps must be >= 1")
        if not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        if self.max_steps <= 0 and self.epochs <= 0:
            raise ValueError("give epochs > 0 or max_steps > 0")
        self._check_specialists()

    def _check_specialists(self) -> None:
        """Specialists mode's own settings, and the settings that mean nothing to it."""
        if self.boost_mode != "specialists":
            defaults = {f.name: f.default for f in fields(self)}
            changed = [name for name in EM_FIELDS if getattr(self, name) != defaults[name]]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} apply only to boost_mode 'specialists', not {self.boost_mode!r}"
                )
            return
        if self.num_ssms < 2:
            raise ValueError(
                f"boost_mode 'specialists' splits the data among num_ssms >= 2, got {self.num_ssms}"
            )
        if self.marking != "sample":
            raise ValueError(
                "marking applies to boost_mode 'greedy' only: specialists assign every sample to one "
                "member and mark nothing; drop the marking option"
            )
        if self.em_rounds < 1:
            raise ValueError(f"em_rounds must be >= 1, got {self.em_rounds}")
        if self.em_feature not in EM_FEATURES:
            raise ValueError(f"em_feature must be one of {', '.join(EM_FEATURES)}, got {self.em_feature!r}")
        if not 0 < self.min_share <= 1:
            raise ValueError(f"min_share must be in (0, 1], got {self.min_share}")
        if self.em_span < 0:
            raise ValueError(
                f"em_span must be >= 1 (output positions per unit) or 0 (whole samples), got {self.em_span}"
            )

    def identity(self) -> dict[str, Any]:
        """Settings a resume must share (more SSMs and a new eval batch size are fine, except in
        specialists mode, whose clusters are num_ssms). Settings at their defaults from before
        they existed are left out, so older runs still resume."""
        free = {"eval_batch_size"} if self.boost_mode == "specialists" else {"num_ssms", "eval_batch_size"}
        if self.loss != "mix":
            free.add("mix_weight")
        if self.loss == "ce":
            free.add("loss")
        if self.boost_mode == "greedy":
            free.add("boost_mode")
        if self.boost_mode != "specialists":
            free.update(EM_FIELDS)
        if self.em_span == 0:  # as before the option existed
            free.add("em_span")
        return {k: v for k, v in asdict(self).items() if k not in free}

    @property
    def needs_distributions(self) -> bool:
        """Whether training uses the LLM's stored distributions (a distribution loss or sampled mode)."""
        return self.loss != "ce" or self.boost_mode == "sampled"

    @property
    def base_name(self) -> str:
        return self.ssm_base if self.ssm_base is not None else f"config:{self.ssm_config}"
