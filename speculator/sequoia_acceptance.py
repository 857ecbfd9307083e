"""Positional acceptance rates of one SSM under one verification rule (ALGORITHMS.md section 8):
the input of Sequoia's tree DP (`sequoia_dp`), and the file a pool ships them in.

`AcceptanceVector.p[j]` is the conditional rate of ALGORITHMS.md, P(child j + 1 of an accepted
node is accepted | children 1..j rejected), with children in the order the drafter fills a
Sequoia topology (the SSM's ranked tokens, or tokens sampled without replacement). The DP's
weights are the marginals (`AcceptanceVector.marginal`). Vectors are measured on held-out data
by `specboost.training.sequoia_acceptance` (`make sequoia-acceptance`), one per SSM of a pool,
into `sequoia_acceptance.json` (`save_acceptance_file`), which `make export` carries into the
exported pool and `SSMPool` loads for `strategy="sequoia"`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specboost.speculator.sampling import SamplingConfig

RULES = ("greedy", "without_replacement")
ACCEPTANCE_FILE = "sequoia_acceptance.json"  # in a boost run / exported pool folder
FORMAT_VERSION = 1


@dataclass(frozen=True)
class AcceptanceVector:
    """p[j]: P(child j + 1 accepted | children 1..j rejected), ALGORITHMS.md section 8's p_k."""

    p: tuple[float, ...]
    rule: str  # "greedy" | "without_replacement"
    num_positions: int  # scored sequence positions
    temperature: float = 1.0  # the sampling settings p was measured at (unused for greedy)
    top_k: int = 0
    top_p: float = 1.0
    simulations: int = 1  # Monte Carlo replays per position (without replacement)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if any(not 0.0 <= x <= 1.0 for x in self.p):
            raise ValueError(f"acceptance rates must lie in [0, 1], got {self.p}")

    @classmethod
    def from_counts(cls, accepted: Sequence[int], trials: int, **fields: Any) -> AcceptanceVector:
        """From `accepted[j]` = trials that accepted the child of rank j + 1."""
        p, left = [], trials
        for count in accepted:
            p.append(count / left if left > 0 else 0.0)
            left -= count
        return cls(tuple(p), **fields)

    @property
    def marginal(self) -> tuple[float, ...]:
        """P(child j + 1 of an accepted node is accepted): the weights of the tree DP."""
        weights, rejected = [], 1.0
        for rate in self.p:
            weights.append(rejected * rate)
            rejected *= 1.0 - rate
        return tuple(weights)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(
            do_sample=self.rule != "greedy", temperature=self.temperature, top_k=self.top_k, top_p=self.top_p
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "p": list(self.p)}

    @classmethod
    def from_dict(cls, data: dict) -> AcceptanceVector:
        return cls(**{**data, "p": tuple(data["p"])})

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AcceptanceVector:
        """From a file written by `save`."""
        data = json.loads(Path(path).read_text())
        if "acceptance" in data:
            raise ValueError(f"{path} holds one vector per SSM of a pool: read it with load_acceptance_file")
        return cls.from_dict(data)


def save_acceptance_file(
    vectors: Sequence[AcceptanceVector], path: str | os.PathLike[str], **extra: Any
) -> None:
    """One vector per SSM of a pool, in pool order, and any JSON-ready `extra` entries (the
    measurement's details), as `ACCEPTANCE_FILE`."""
    data = {"format_version": FORMAT_VERSION, "acceptance": [v.to_dict() for v in vectors], **extra}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_acceptance_file(path: str | os.PathLike[str]) -> list[AcceptanceVector]:
    """The per-SSM vectors of a file written by `save_acceptance_file`."""
    data = json.loads(Path(path).read_text())
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {data.get('format_version')!r}; this specboost reads "
            f"{FORMAT_VERSION}: measure again with `make sequoia-acceptance`"
        )
    return [AcceptanceVector.from_dict(entry) for entry in data["acceptance"]]
