"""Training one boost round's SSM with transformers' Trainer: its arguments, `DistributionTrainer`
(the distribution losses, per-position weights), resuming from the last checkpoint, the atomic save."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerState, TrainingArguments
from transformers.integrations import unset_hf_deepspeed_config

from specboost.training.boost_config import BoostConfig
from specboost.training.boost_data import ExampleSet, PadCollator
from specboost.training.distribution_loss import position_losses
from specboost.training.reference_llm import last_checkpoint


def planned_steps(config: BoostConfig, examples: int) -> int:
    """The optimizer steps one round takes on `examples`: max_steps, else epochs over them."""
    if config.max_steps > 0:
        return config.max_steps
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_epoch = math.ceil(examples / (config.batch_size * config.grad_accum_steps * world))
    return math.ceil(config.epochs * per_epoch)


def training_arguments(
    config: BoostConfig, checkpoints: Path, round_index: int, examples: int
) -> TrainingArguments:
    cuda = torch.cuda.is_available()
    total = planned_steps(config, examples)
    bf16 = cuda and torch.cuda.is_bf16_supported()
    return TrainingArguments(
        output_dir=str(checkpoints),
        num_train_epochs=config.epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum_steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=2,
        logging_steps=max(1, min(config.logging_steps, total)),  # at least one logged loss
        use_cpu=not cuda,
        bf16=bf16,  # mixed precision only on GPUs that have it; fp32 on CPU
        fp16=cuda and not bf16,
        seed=config.seed + round_index,
        data_seed=config.seed + round_index,
        report_to="none",
        dataloader_num_workers=0,
        remove_unused_columns=False,  # our collator builds the batch
    )


def save_ssm(trainer: Trainer, tokenizer: PreTrainedTokenizerBase, lora: bool, final: Path) -> None:
    """Write `final` through a temporary folder, so that it exists only complete."""
    tmp = final.with_name(final.name + ".tmp")
    if trainer.args.should_save:
        shutil.rmtree(tmp, ignore_errors=True)
    if lora:  # merge the adapters into the weights: a plain model for the decoder
        if trainer.args.should_save:
            trainer.accelerator.unwrap_model(trainer.model).merge_and_unload().save_pretrained(tmp)
    else:
        trainer.save_model(str(tmp))  # gathers ZeRO-3 shards; writes on the main process only
    if trainer.args.should_save:
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    trainer.accelerator.wait_for_everyone()


class DistributionTrainer(Trainer):
    """A Trainer whose loss is `distribution_loss.position_losses` of kind `loss` (ce / kl / tv /
    mix) at the output positions (labels != -100), each weighted by the batch's "weights" when
    present (sampled boost mode), summed and divided by the number of trained positions.

    The sum is divided by `num_items_in_batch` (the labelled positions of the whole accumulated
    batch, over every process) when the Trainer counts them, as transformers' own causal-LM loss
    does, so the loss is already scaled for gradient accumulation; else by this micro-batch's
    positions and the accumulation steps."""

    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, loss: str, temperature: float | None, mix_weight: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loss_kind, self.temperature, self.mix_weight = loss, temperature, mix_weight

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        labels = inputs["labels"][:, 1:]  # [B, T-1]: position j's logits predict token j + 1
        valid = labels != -100
        logits = outputs.logits[:, :-1][valid]  # [N, V]
        targets = None
        if "target_ids" in inputs:
            targets = tuple(inputs[k][:, 1:][valid] for k in ("target_ids", "target_probs", "target_tail"))
        losses = position_losses(
            self.loss_kind, logits, labels[valid], targets, self.temperature, self.mix_weight
        )  # [N]
        if "weights" in inputs:
            losses = losses * inputs["weights"][:, 1:][valid]
        if num_items_in_batch is not None:
            loss = losses.sum() / num_items_in_batch
            if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
                loss = loss * self.accelerator.num_processes  # DDP averages the gradients
        else:
            steps = getattr(self, "current_gradient_accumulation_steps", 1)
            loss = losses.sum() / valid.sum().clamp(min=1) / steps
        return (loss, outputs) if return_outputs else loss


def train_round(
    config: BoostConfig,
    round_index: int,
    train_set: datasets.Dataset | ExampleSet,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    temperature: float | None = None,
    *,
    checkpoints: Path | None = None,
    final: Path | None = None,
) -> tuple[int, float | None]:
    """Train (or resume) one SSM and save it to `final` (default OUT/ssm-<i>), checkpointing in
    `checkpoints` (default OUT/round-<i>/checkpoints); returns (steps, final logged loss).
    `round_index` also seeds the data order. Examples with weights or stored distributions (an
    ExampleSet) train with DistributionTrainer (q at `temperature`, the one p was recorded at);
    plain ones with the model's own loss."""
    checkpoints = checkpoints or out / f"round-{round_index}" / "checkpoints"
    resume = last_checkpoint(checkpoints)
    common = dict(
        model=model,
        args=training_arguments(config, checkpoints, round_index, len(train_set)),
        train_dataset=train_set,
        data_collator=PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
    )
    if isinstance(train_set, ExampleSet):
        extra = dict(loss=config.loss, temperature=temperature, mix_weight=config.mix_weight)
        trainer: Trainer = DistributionTrainer(**common, **extra)
    else:
        trainer = Trainer(**common)
    finished = resume is not None and finished_checkpoint(resume)
    if finished:  # killed after training: Trainer.train would take one step too many from here
        trainer._load_from_checkpoint(str(resume))
        trainer.state = TrainerState.load_from_json(str(resume / "trainer_state.json"))
    else:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    save_ssm(trainer, tokenizer, config.lora, final or out / f"ssm-{round_index}")
    if trainer.is_deepspeed_enabled:
        # The DeepSpeed config stays registered with transformers for the whole process; under
        # ZeRO-3 every later from_pretrained would then partition the SSM it loads, and marking
        # and scoring need the saved SSM whole. The next round's TrainingArguments register it again.
        unset_hf_deepspeed_config()
    return trainer.state.global_step, float(losses[-1]) if losses else None


def finished_checkpoint(checkpoint: Path) -> bool:
    """Whether the checkpoint was saved at the end of training (its step is the run's last)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return state["global_step"] >= state["max_steps"] > 0
