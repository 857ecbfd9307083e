"""A pool of SSMs of one architecture run as ONE model, so that the whole pool drafts a tree level
in one forward pass (ALGORITHMS.md section 3: "running the SSMs in parallel costs about one SSM's
latency").

`stack_pool(models)` copies the first member's module tree and replaces every leaf module that
holds parameters by a stacked version over all members: `nn.Linear` becomes one batched matmul
over the members' weights, `nn.Embedding` one lookup in the members' concatenated tables, and any
other leaf (the norms) runs under `torch.vmap` over the members' stacked parameters
(`torch.func.stack_module_state` + `functional_call`). Everything else (attention, rotary
embeddings, the KV cache, the masks) is the library's own code, unchanged. A batch of P * B rows
is laid out member-major: rows p*B .. p*B + B - 1 run member p.

A pool is stacked only if its members share class, configuration, dtype, device and parameter
shapes, and a probe forward of the stacked model reproduces every member's own logits;
`why_not_stackable` names the first reason it cannot be (the decoder then drafts with the
members one after another).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

PROBE_TOKENS = 8  # tokens of the probe forward that checks a stacked pool against its members


class StackedLinear(nn.Module):
    """P `nn.Linear` layers applied to their own rows: x [P*B, ..., in] -> [P*B, ..., out]."""

    def __init__(self, layers: Sequence[nn.Linear]) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.stack([layer.weight.t() for layer in layers]).contiguous()
        )  # [P, in, out]
        biases = [layer.bias for layer in layers]
        self.bias = None if biases[0] is None else nn.Parameter(torch.stack(biases)[:, None])  # [P, 1, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        members, width = self.weight.shape[0], x.shape[-1]
        grouped = x.reshape(members, -1, width)  # [P, rows * ..., in]
        y = (
            torch.bmm(grouped, self.weight)
            if self.bias is None
            else torch.baddbmm(self.bias, grouped, self.weight)
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])


class StackedEmbedding(nn.Module):
    """P `nn.Embedding` tables, each looked up by its own rows: ids [P*B, ...] -> [P*B, ..., H]."""

    def __init__(self, tables: Sequence[nn.Embedding]) -> None:
        super().__init__()
        first = tables[0]
        self.weight = nn.Parameter(torch.cat([table.weight for table in tables]))  # [P * V, H]
        self.members, self.rows_per_table = len(tables), first.weight.shape[0]
        self.padding_idx = first.padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] % self.members:
            raise ValueError(
                f"{ids.shape[0]} rows of ids for {self.members} stacked tables: pass ids for every row"
            )
        member = torch.arange(self.members, device=ids.device).repeat_interleave(ids.shape[0] // self.members)
        offset = (member * self.rows_per_table).view(-1, *[1] * (ids.dim() - 1))
        return nn.functional.embedding(ids + offset, self.weight)


class StackedLeaf(nn.Module):
    """Any other leaf module with parameters (a norm, a learned position embedding), run by each
    member on its own rows. A leaf that takes one tensor and uses its parameters elementwise (the
    RMS and Gemma norms) runs once on the rows grouped [P, B, ...] with its parameters shaped to
    broadcast [P, 1, ..., *shape]; any other runs under `torch.vmap` over the members' stacked
    parameters, every tensor argument with one row per batch row split by member. Which of the two
    is decided at the first call: broadcasting is used only if it gives exactly vmap's result."""

    def __init__(self, leaves: Sequence[nn.Module]) -> None:
        super().__init__()
        self.template = copy.deepcopy(leaves[0])
        params, _ = torch.func.stack_module_state(list(leaves))
        self.names = list(params)
        self.stacked = nn.ParameterList([nn.Parameter(params[name].detach()) for name in self.names])
        self.broadcasts: bool | None = None  # decided at the first call

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        if self.broadcasts:
            return self._broadcast(args[0])
        if self.broadcasts is None:
            mapped = self._vmapped(*args, **kwargs)
            self.broadcasts = len(args) == 1 and not kwargs and self._same(self._broadcast, args[0], mapped)
            return mapped
        return self._vmapped(*args, **kwargs)

    def _same(
        self, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, expected: torch.Tensor
    ) -> bool:
        try:
            with warnings.catch_warnings():  # a leaf that does not broadcast may warn on the way
                warnings.simplefilter("ignore")
                return torch.equal(run(x), expected)
        except (RuntimeError, ValueError):  # parameters that do not broadcast (e.g. F.layer_norm's)
            return False

    def _broadcast(self, x: torch.Tensor) -> torch.Tensor:
        members = len(self.stacked[0])
        grouped = x.reshape(members, -1, *x.shape[1:])  # [P, B, ...]
        params = {
            name: p.view(members, *[1] * (grouped.dim() - p.dim()), *p.shape[1:])
            for name, p in zip(self.names, self.stacked, strict=True)
        }
        return torch.func.functional_call(self.template, params, (grouped,)).reshape(x.shape)

    def _vmapped(self, *args: object, **kwargs: object) -> torch.Tensor:
        members = len(self.stacked[0])
        rows = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)).shape[0]
        if rows % members:
            raise ValueError(f"{rows} rows for {members} stacked members: pass inputs for every row")

        def split(value: object) -> tuple[object, int | None]:
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
                return value.reshape(members, -1, *value.shape[1:]), 0  # [P, B, ...]
            return value, None

        positional = [split(a) for a in args]
        names = list(kwargs)
        keyword = [split(kwargs[name]) for name in names]

        def run(member_params: dict[str, torch.Tensor], *values: object) -> torch.Tensor:
            call_args, call_kwargs = values[: len(args)], dict(zip(names, values[len(args) :], strict=True))
            return torch.func.functional_call(self.template, member_params, call_args, call_kwargs)

        params = dict(zip(self.names, self.stacked, strict=True))
        in_dims = (0, *(dim for _, dim in positional), *(dim for _, dim in keyword))
        values = [value for value, _ in (*positional, *keyword)]
        y = torch.vmap(run, in_dims=in_dims)(params, *values)
        return y.reshape(rows, *y.shape[2:])


def why_not_stackable(models: Sequence[PreTrainedModel]) -> str | None:
    """Why `models` cannot run as one stacked model (None if they can; one model needs no stacking)."""
    if len(models) < 2:
        return "a single SSM"
    first = models[0]
    for i, model in enumerate(models[1:], start=1):
        if type(model) is not type(first):
            return f"SSM {i} is a {type(model).__name__}, SSM 0 a {type(first).__name__}"
        if model.dtype != first.dtype or model.device != first.device:
            return f"SSM {i} is {model.dtype} on {model.device}, SSM 0 {first.dtype} on {first.device}"
        if _architecture(model) != _architecture(first):
            return f"SSM {i}'s configuration differs from SSM 0's"
        shapes = {name: p.shape for name, p in model.named_parameters()}
        if shapes != {name: p.shape for name, p in first.named_parameters()}:
            return f"SSM {i}'s parameters differ from SSM 0's in name or shape"
    return None


def stack_pool(models: Sequence[PreTrainedModel]) -> PreTrainedModel:
    """One model running every member of `models` on its own block of rows (see the module doc).
    Raises ValueError naming why when the pool cannot be stacked or the stacked model does not
    reproduce its members."""
    reason = why_not_stackable(models)
    if reason is not None:
        raise ValueError(f"the SSMs cannot be stacked: {reason}")
    modules = [dict(model.named_modules()) for model in models]
    with torch.no_grad():
        pooled = copy.deepcopy(models[0]).eval()
        for name, module in list(pooled.named_modules()):
            if next(module.children(), None) is not None or not list(module.parameters(recurse=False)):
                continue
            leaves = [found[name] for found in modules]
            stacked = _stacked(module, leaves).requires_grad_(False)
            parent, _, attribute = name.rpartition(".")
            setattr(pooled.get_submodule(parent), attribute, stacked)
        check_stacked(pooled, models)
    pooled.stacked_members = len(models)  # its caches' rows come in blocks of one per member
    return pooled


def _stacked(module: nn.Module, leaves: list[nn.Module]) -> nn.Module:
    if type(module) is nn.Linear:
        return StackedLinear(leaves)
    if type(module) is nn.Embedding:
        return StackedEmbedding(leaves)
    return StackedLeaf(leaves)


def check_stacked(pooled: PreTrainedModel, models: Sequence[PreTrainedModel]) -> None:
    """Raise ValueError unless the stacked model's logits equal each member's on a probe input
    (up to the rounding of a batched matmul in the models' dtype)."""
    vocab = models[0].get_output_embeddings().weight.shape[0]
    positions = torch.arange(PROBE_TOKENS, device=models[0].device)[None]  # [1, T]
    probe = positions * 7 % vocab
    with torch.no_grad():
        expected = torch.cat([model(input_ids=probe, position_ids=positions).logits for model in models])
        members = len(models)
        actual = pooled(input_ids=probe.repeat(members, 1), position_ids=positions.repeat(members, 1)).logits
    tolerance = 1e-4 if models[0].dtype in (torch.float32, torch.float64) else 3e-2
    if not torch.allclose(actual.float(), expected.float(), rtol=tolerance, atol=tolerance):
        raise ValueError(
            f"the stacked pool does not reproduce its SSMs ({type(models[0]).__name__} has a layer "
            "that cannot be stacked)"
        )


def _architecture(model: PreTrainedModel) -> dict:
    """The configuration fields that shape the computation (not names or paths)."""
    config = model.config.to_dict()
    for key in ("_name_or_path", "name_or_path", "transformers_version", "architectures", "_commit_hash"):
        config.pop(key, None)
    return config
