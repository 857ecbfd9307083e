"""Match-length predictor: a 3-layer MLP from the LLM's last hidden state to the expected match
length of every speculation configuration of every SSM (ALGORITHMS.md section 5).

A configuration is SpecInfer beam search of width b and depth d; the grid is b in {1, 2, 4} x
d in {1, 2, 4, 8, 16} per SSM. The model standardises its input with statistics of the training
hidden states (stored as buffers, so a saved predictor is self-contained) and its outputs are
clamped to the achievable range [0, d] at inference.

Saved as `predictor.safetensors` + `predictor_config.json` (in an exported pool folder, next to
the SSMs, so that `SSMPool.from_pretrained` finds it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

WIDTHS = (1, 2, 4)
DEPTHS = (1, 2, 4, 8, 16)
WEIGHTS_FILE = "predictor.safetensors"
CONFIG_FILE = "predictor_config.json"
PREDICTOR_DIR = "predictor"  # its folder inside a boost run or an exported pool


@dataclass(frozen=True)
class PredictorConfig:
    input_size: int  # the LLM's hidden size
    num_ssms: int
    widths: tuple[int, ...] = WIDTHS
    depths: tuple[int, ...] = DEPTHS
    hidden_size: int = 256
    llm: str | None = None  # name_or_path of the LLM whose hidden states it reads
    ssms: tuple[str, ...] = field(default=())  # the SSMs' names, in pool order

    def __post_init__(self) -> None:
        if self.input_size < 1 or self.num_ssms < 1 or self.hidden_size < 1:
            raise ValueError("input_size, num_ssms and hidden_size must be >= 1")
        if not self.widths or not self.depths or min(self.widths) < 1 or min(self.depths) < 1:
            raise ValueError(f"widths and depths must be positive, got {self.widths} and {self.depths}")
        object.__setattr__(self, "widths", tuple(self.widths))
        object.__setattr__(self, "depths", tuple(self.depths))
        object.__setattr__(self, "ssms", tuple(self.ssms))

    @property
    def num_outputs(self) -> int:
        return self.num_ssms * len(self.widths) * len(self.depths)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return (self.num_ssms, len(self.widths), len(self.depths))


class MatchLengthPredictor(nn.Module):
    """f(b, d | h) for every SSM: [..., H] -> [..., num_ssms, len(widths), len(depths)]."""

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__()
        self.config = config
        m = config.hidden_size
        self.mlp = nn.Sequential(
            nn.Linear(config.input_size, m),
            nn.ReLU(),
            nn.Linear(m, m),
            nn.ReLU(),
            nn.Linear(m, config.num_outputs),
        )
        self.register_buffer("input_mean", torch.zeros(config.input_size))
        self.register_buffer("input_std", torch.ones(config.input_size))
        self.register_buffer("max_length", torch.tensor(config.depths, dtype=torch.float32))

    def set_input_statistics(self, hidden: torch.Tensor) -> None:
        """Standardise inputs with the mean / std of training hidden states [N, H]."""
        self.input_mean.copy_(hidden.float().mean(0))
        self.input_std.copy_(hidden.float().std(0).clamp_min(1e-6))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw regression outputs (training)."""
        x = (hidden.to(self.input_mean.dtype) - self.input_mean) / self.input_std
        return self.mlp(x).unflatten(-1, self.config.output_shape)

    @torch.inference_mode()
    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """Expected match lengths, clamped to [0, d]."""
        return self(hidden).clamp_(min=0).minimum(self.max_length)

    def _folded(self) -> tuple[torch.Tensor, ...]:
        """(w1, b1, w2, b2, w3, b3): the MLP's frozen weights, the input standardisation folded
        into the first layer."""
        first, second, last = (layer for layer in self.mlp if isinstance(layer, nn.Linear))
        w1 = first.weight / self.input_std
        b1 = first.bias - w1 @ self.input_mean
        return w1, b1, second.weight.clone(), second.bias.clone(), last.weight.clone(), last.bias.clone()

    def compiled(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`predict` for hidden states [..., H] -> [..., num_ssms, widths * depths], with the input
        standardisation folded into the first layer and no module dispatch: the scheduler calls
        it every decoding step, where a few microseconds per op add up. Frozen weights."""
        head, ssms = self.head(), self.config.num_ssms
        return lambda hidden: apply_head(hidden, head).unflatten(-1, (ssms, -1))

    @torch.inference_mode()
    def head(self, width: int | None = None) -> PassHead:
        """The predictor as plain tensors (`PassHead`), of one beam width or of all (None): hidden
        states [..., H] -> [..., num_ssms * depths] (all widths: [..., num_ssms * widths * depths],
        b major within each SSM), clamped to [0, d]. Only that width's rows of the last layer are
        kept; the input standardisation is folded into the first layer. Frozen weights."""
        if width is not None and width not in self.config.widths:
            raise ValueError(f"the predictor has no width {width}; its widths are {self.config.widths}")
        w1, b1, w2, b2, w3, b3 = self._folded()
        ssms, widths, depths = self.config.num_ssms, len(self.config.widths), len(self.config.depths)
        outputs = torch.arange(self.config.num_outputs, device=w3.device).view(ssms, widths, depths)
        if width is not None:
            outputs = outputs[:, self.config.widths.index(width)]
        outputs = outputs.flatten()
        cap = self.max_length.repeat(len(outputs) // depths)  # each output's depth
        return PassHead(*(t.float() for t in (w1, b1, w2, b2, w3[outputs], b3[outputs], cap)))

    def on_host(self, width: int) -> Callable[[np.ndarray], np.ndarray]:
        """`head(width)` in numpy: hidden states [..., H] -> [..., num_ssms, depths]. The routed
        scheduler (ALGORITHMS.md 5.3) reads width 1 every step where its LLM's pass does not apply
        the head itself (an eager decoder); on a CPU three small matmuls in numpy cost about half of
        torch's calls (dispatch)."""
        w1, b1, w2, b2, w3, b3, cap = (t.detach().float().cpu().numpy() for t in self.head(width))
        w1t, w2t, w3t = (np.ascontiguousarray(w.T) for w in (w1, w2, w3))
        shape = (self.config.num_ssms, len(self.config.depths))

        def predict_states(hidden: np.ndarray) -> np.ndarray:
            x = np.maximum(hidden.astype(np.float32, copy=False) @ w1t + b1, 0)
            x = np.maximum(x @ w2t + b2, 0)
            return np.clip(x @ w3t + b3, 0, cap).reshape(*x.shape[:-1], *shape)

        return predict_states

    def save_pretrained(self, folder: str | Path) -> None:
        """Weights first, then the config that `has_predictor` looks for; each file is written to a
        temporary name and renamed, so a killed save never leaves a half-written file."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        weights_tmp = folder / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
        save_file(state, weights_tmp)
        os.replace(weights_tmp, folder / WEIGHTS_FILE)
        config_tmp = folder / f".{CONFIG_FILE}.tmp-{os.getpid()}"
        config_tmp.write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        os.replace(config_tmp, folder / CONFIG_FILE)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> MatchLengthPredictor:
        folder = Path(folder)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (folder / name).is_file():
                raise FileNotFoundError(
                    f"no match-length predictor in {folder} ({name} is missing); train one with "
                    "`python -m specboost.training.train_predictor` (`make predictor`)"
                )
        config = PredictorConfig(**json.loads((folder / CONFIG_FILE).read_text()))
        model = cls(config)
        model.load_state_dict(load_file(folder / WEIGHTS_FILE))
        return model.eval()


def has_predictor(folder: str | Path) -> bool:
    return (Path(folder) / CONFIG_FILE).is_file()


class PassHead(NamedTuple):
    """`MatchLengthPredictor.head`: one width's MLP as tensors, which a model's pass takes as
    inputs and applies to its last hidden states (`apply_head`): the routed scheduler's estimates
    then come out of the LLM's compiled verify pass with its logits (ALGORITHMS.md 5.3, "Cost of
    deciding"), not from a dozen host calls after it."""

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    w3: torch.Tensor
    b3: torch.Tensor
    cap: torch.Tensor  # [S * D] each output's depth

    @property
    def key(self) -> tuple[int, ...]:
        """The sizes a compiled pass is made for: (H, hidden units, outputs)."""
        return (*self.w1.shape[::-1], self.w3.shape[0])


def apply_head(hidden: torch.Tensor, head: PassHead) -> torch.Tensor:
    """[..., H] hidden states -> [..., S * D] the head's clamped estimates (float32)."""
    x = F.relu(F.linear(hidden.float(), head.w1, head.b1))
    x = F.relu(F.linear(x, head.w2, head.b2))
    return torch.minimum(F.linear(x, head.w3, head.b3).clamp(min=0), head.cap)
