"""Every tensor the decode loop creates is created on the model's device: a factory call
(`torch.tensor`, `arange`, `zeros`, ...) made by specboost code without `device=` would land on
the CPU and cost a host-device copy per step on a GPU (or fail there). The check intercepts every
factory call during `generate` and fails on any that specboost makes without a device."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import noisy_copy, tiny_llama
from torch.overrides import TorchFunctionMode

from specboost.decoder import BeamShape, ChainShape, SpeculativeDecoder, TopologyShape

FACTORIES = {
    torch.tensor,
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.as_tensor,
}


class DevicelessFactories(TorchFunctionMode):
    """Records the specboost call sites of factory calls that name no device."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith("torch"):
                frame = frame.f_back
            module = frame.f_globals.get("__name__", "") if frame is not None else ""
            if module.startswith("specboost."):
                self.sites.add(f"{module}:{frame.f_lineno}")
        return func(*args, **kwargs)


CONFIGS = {
    "chain": dict(shape=ChainShape(3)),
    "beam": dict(shape=BeamShape(2, 2)),
    "topology": dict(shape=TopologyShape.from_children_counts([[2], [1, 1]])),
    "majority": dict(shape=ChainShape(2), strategy="majority"),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("do_sample", [False, True])
def test_the_decode_loop_creates_tensors_on_the_models_device(config: str, do_sample: bool) -> None:
    llm = tiny_llama(layers=2, seed=0)
    ssms = [noisy_copy(llm, 0.1, seed=1), noisy_copy(llm, 0.2, seed=2)]
    dec = SpeculativeDecoder(llm, ssms, **CONFIGS[config])
    ids = torch.tensor([[3, 5, 7, 11]])
    batch = torch.tensor([[3, 5, 7, 11], [0, 0, 2, 4]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    options = dict(max_new_tokens=12, do_sample=do_sample, seed=0 if do_sample else None)
    if do_sample and config == "majority":
        options["temperature"] = 0.9
    with DevicelessFactories() as mode:
        dec.generate(ids, **options)
        dec.generate(batch, attention_mask=mask, **options)
    assert not mode.sites, f"tensors created without a device at {sorted(mode.sites)}"
