"""A training script in the shape of ROLL's ``mcore_adapter/examples/train/run_train.py``:
the same calls, in the same order, on hpc-mca's names (only the import lines name
``hpc_mca`` where ROLL's name ``mcore_adapter``). Run by tests/test_roll_script.py through
``hpc-mca run`` with the command lines of ROLL's launchers (run_sft_train.sh,
run_dpo_train.sh), against ``hpc-mca train`` on the same data.

Flow, per stage: parse ``Seq2SeqTrainingArguments`` beside LLaMA-Factory's argument classes;
load LLaMA-Factory's tokenizer and template; build the model with ``AutoModel.from_pretrained``;
(pt, sft with LoRA) put peft's LoRA on the chunk after ``apply_megatron_lora``; (dpo) build the
reference with ``AutoConfig`` + ``AutoModel.from_config`` + ``load_state_dict``; read the data
with LLaMA-Factory's ``get_dataset`` at ``cutoff_len + 1``; collate with LLaMA-Factory's
collators wrapped by a wrapper that drops the last input token and the first label (the
pre-shifted convention); train with ``McaTrainer`` / ``DPOTrainer(train_config=DPOConfig)``.
One addition to ROLL's flow: dpo applies LoRA too when asked (after building the reference),
where ROLL's dpo trains the full model whatever ``finetuning_type`` says. At the end, as
LLaMA-Factory's own mca workflow, it evaluates and saves the model; rank 0 writes
``OUTPUT_DIR/script_report.json`` (the TrainOutput and evaluate()'s metrics).
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lf_compat  # noqa: F401 - LLaMA-Factory 0.9.5's imports in this environment
import torch
from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
from llamafactory.data.collator import PairwiseDataCollatorWithPadding, SFTDataCollatorWith4DAttentionMask
from llamafactory.hparams import DataArguments, FinetuningArguments, GeneratingArguments, ModelArguments
from llamafactory.model import load_tokenizer
from peft import LoraConfig, get_peft_model
from transformers import DataCollatorForSeq2Seq, HfArgumentParser

from hpc_mca.adapters import apply_megatron_lora, find_all_linear_modules, set_linear_is_expert
from hpc_mca.models import AutoConfig, AutoModel
from hpc_mca.trainer import DPOTrainer, McaTrainer
from hpc_mca.trainer.dpo_config import DPOConfig
from hpc_mca.training_args import Seq2SeqTrainingArguments

ARGUMENT_CLASSES = (Seq2SeqTrainingArguments, ModelArguments, DataArguments, FinetuningArguments,
                    GeneratingArguments)


def parse(argv: Sequence[str]) -> tuple[Any, ...]:
    return HfArgumentParser(ARGUMENT_CLASSES).parse_args_into_dataclasses(list(argv))


def preshifted(collator: Callable[[list[dict[str, Any]]], Any]) -> Callable[[list[dict[str, Any]]], Any]:
    """The collator on features cut to Megatron's convention first: every ``*input_ids`` loses
    its last token, every ``*labels`` its first (pt: labels are the inputs one token on), and
    ``attention_mask`` / ``position_ids`` their last slot (a pair's ``chosen_attention_mask``
    keeps it, as ROLL's wrapper leaves it)."""
    @functools.wraps(collator)
    def collate(features: list[dict[str, Any]]) -> Any:
        label_keys = [key for key in features[0] if key.endswith("labels")]
        id_keys = [key for key in features[0] if key.endswith("input_ids")]
        for feature in features:
            if not label_keys:
                feature["labels"] = copy.deepcopy(feature["input_ids"])[1:]
            for key in label_keys:
                feature[key] = feature[key][1:]
            for key in id_keys:
                feature[key] = feature[key][:-1]
            for key in ("attention_mask", "position_ids"):
                if key in feature:
                    feature[key] = feature[key][:-1]
        return collator(features)

    return collate


def add_lora(chunk: torch.nn.Module, finetuning_args: Any) -> torch.nn.Module:
    chunk.enable_input_require_grads()
    config = LoraConfig(r=finetuning_args.lora_rank, target_modules=find_all_linear_modules(chunk),
                        lora_alpha=finetuning_args.lora_alpha, lora_dropout=finetuning_args.lora_dropout)
    chunk = get_peft_model(chunk, config)
    for parameter in chunk.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.to(torch.float32)
    return chunk


def with_lora(model: Any, finetuning_args: Any) -> None:
    if finetuning_args.finetuning_type == "lora":
        apply_megatron_lora()
        set_linear_is_expert(model[0])
        model.models[0] = add_lora(model[0], finetuning_args)


def freeze_vision_language(model: Any, finetuning_args: Any) -> None:
    """ROLL's sft freezes parts of a qwen2_vl model by their Megatron names; a text model
    (every model here) has none of them."""
    if model.config.hf_model_type not in ("qwen2_vl",):
        return
    frozen: list[str] = []
    if finetuning_args.freeze_vision_tower:
        frozen += ["vision_model.blocks", "vision_model.patch_embed"]
    if finetuning_args.freeze_multi_modal_projector:
        frozen.append("multi_modal_projector")
    if finetuning_args.freeze_language_model:
        frozen += ["embedding", "decoder", "output_layer"]
    for name, parameter in model.named_parameters():
        if name.startswith(tuple(frozen)):
            parameter.requires_grad_(False)


def read_data(template: Any, model_args: Any, data_args: Any, training_args: Any, stage: str,
              tokenizer_module: dict[str, Any]) -> dict[str, Any]:
    data_args.cutoff_len += 1  # the wrapper takes one token off again
    try:
        return get_dataset(template, model_args, data_args, training_args, stage=stage, **tokenizer_module)
    finally:
        data_args.cutoff_len -= 1


def train_pt(training_args: Any, model_args: Any, data_args: Any, finetuning_args: Any) -> Any:
    tokenizer_module = load_tokenizer(model_args)
    tokenizer = tokenizer_module["tokenizer"]
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    model = AutoModel.from_pretrained(model_args.model_name_or_path, training_args)
    with_lora(model, finetuning_args)
    data = read_data(template, model_args, data_args, training_args, "pt", tokenizer_module)
    collator = preshifted(DataCollatorForSeq2Seq(tokenizer=tokenizer, pad_to_multiple_of=8,
                                                 label_pad_token_id=-100))
    trainer = McaTrainer(model=model, args=training_args, tokenizer=tokenizer, data_collator=collator, **data)
    return trainer, trainer.train(training_args.resume_from_checkpoint)


def train_sft(training_args: Any, model_args: Any, data_args: Any, finetuning_args: Any) -> Any:
    data_args.neat_packing = training_args.sequence_packing = data_args.neat_packing or training_args.sequence_packing
    data_args.packing = data_args.neat_packing or data_args.packing
    tokenizer_module = load_tokenizer(model_args)
    tokenizer = tokenizer_module["tokenizer"]
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    model = AutoModel.from_pretrained(model_args.model_name_or_path, training_args)
    data = read_data(template, model_args, data_args, training_args, "sft", tokenizer_module)
    with_lora(model, finetuning_args)
    freeze_vision_language(model, finetuning_args)
    pad_to_max = bool(training_args.expert_model_parallel_size and training_args.expert_model_parallel_size > 1
                      and not training_args.variable_seq_lengths)
    collator = preshifted(SFTDataCollatorWith4DAttentionMask(
        template=template, padding="max_length" if pad_to_max else "longest",
        max_length=data_args.cutoff_len if pad_to_max else None, pad_to_multiple_of=64,
        label_pad_token_id=-100, **tokenizer_module))
    trainer = McaTrainer(model=model, args=training_args, tokenizer=tokenizer, data_collator=collator, **data)
    return trainer, trainer.train(training_args.resume_from_checkpoint)


def train_dpo(training_args: Any, model_args: Any, data_args: Any, finetuning_args: Any) -> Any:
    tokenizer_module = load_tokenizer(model_args)
    tokenizer = tokenizer_module["tokenizer"]
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    model = AutoModel.from_pretrained(model_args.model_name_or_path, training_args)
    reference = None
    if finetuning_args.use_ref_model:
        reference = AutoModel.from_config(AutoConfig.from_pretrained(model_args.model_name_or_path, training_args))
        reference.load_state_dict(model.state_dict())
    with_lora(model, finetuning_args)
    data = read_data(template, model_args, data_args, training_args, "rm", tokenizer_module)
    pad_to_max = bool(training_args.expert_model_parallel_size and training_args.expert_model_parallel_size > 1)
    loss = DPOConfig(beta=finetuning_args.pref_beta, pref_loss=finetuning_args.pref_loss,
                     label_smoothing=finetuning_args.dpo_label_smoothing)
    collator = preshifted(PairwiseDataCollatorWithPadding(
        template=template, pad_to_multiple_of=64, padding="max_length" if pad_to_max else "longest",
        max_length=data_args.cutoff_len if pad_to_max else None, label_pad_token_id=-100, **tokenizer_module))
    trainer = DPOTrainer(model=model, ref_model=reference, args=training_args, train_config=loss,
                         tokenizer=tokenizer, data_collator=collator, **data)
    return trainer, trainer.train(training_args.resume_from_checkpoint)


STAGES = {"pt": train_pt, "sft": train_sft, "dpo": train_dpo}


def main(argv: Sequence[str]) -> None:
    training_args, model_args, data_args, finetuning_args, _ = parse(argv)
    model_args.model_max_length = data_args.cutoff_len
    model_args.block_diag_attn = data_args.neat_packing
    if data_args.packing is None:
        data_args.packing = finetuning_args.stage == "pt"
    if finetuning_args.stage not in STAGES:
        raise ValueError(f"stage {finetuning_args.stage!r}; valid: {', '.join(STAGES)}")
    trainer, output = STAGES[finetuning_args.stage](training_args, model_args, data_args, finetuning_args)
    evaluated = trainer.evaluate() if trainer.data.eval is not None else {}
    trainer.save_model()  # as LLaMA-Factory's own mca workflow ends
    if trainer.is_world_process_zero():
        report = {"global_step": output.global_step, "training_loss": output.training_loss,
                  "evaluate": evaluated}
        (Path(training_args.output_dir) / "script_report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
