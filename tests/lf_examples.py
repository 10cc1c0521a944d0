"""LLaMA-Factory's example training YAMLs, as data shared by tests/test_lf_keys.py (they load)
and tests/test_lf_examples.py (they train): its ``examples/<name>``, key for key and value for
value (comments left out; these are configuration facts)."""

from __future__ import annotations

COMMON = {
    "trust_remote_code": True, "do_train": True, "cutoff_len": 2048, "max_samples": 1000,
    "preprocessing_num_workers": 16, "dataloader_num_workers": 4, "logging_steps": 10,
    "save_steps": 500, "plot_loss": True, "overwrite_output_dir": True, "save_only_model": False,
    "report_to": "none", "per_device_train_batch_size": 1, "num_train_epochs": 3.0,
    "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": True, "ddp_timeout": 180000000,
    "resume_from_checkpoint": None,
}
LORA = {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all"}
EXAMPLES = {
    "train_full/qwen3_full_sft.yaml": {
        "model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507", "stage": "sft",
        "finetuning_type": "full", "deepspeed": "examples/deepspeed/ds_z3_config.json",
        "dataset": "identity,alpaca_en_demo", "template": "qwen3_nothink",
        "output_dir": "saves/qwen3-4b/full/sft", "gradient_accumulation_steps": 2,
        "learning_rate": 1.0e-5, **COMMON},
    "train_lora/qwen3_lora_sft.yaml": {
        "model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507", "stage": "sft", **LORA,
        "dataset": "identity,alpaca_en_demo", "template": "qwen3_nothink",
        "output_dir": "saves/qwen3-4b/lora/sft", "gradient_accumulation_steps": 8,
        "learning_rate": 1.0e-4, **COMMON},
    "train_lora/qwen3_lora_dpo.yaml": {
        "model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507", "stage": "dpo", **LORA,
        "pref_beta": 0.1, "pref_loss": "sigmoid", "dataset": "dpo_en_demo",
        "template": "qwen3_nothink", "output_dir": "saves/qwen3-4b/lora/dpo",
        "gradient_accumulation_steps": 8, "learning_rate": 5.0e-6, **COMMON},
    # LLaMA-Factory's kto example has neither save_only_model nor resume_from_checkpoint.
    "train_lora/qwen3_lora_kto.yaml": {
        "model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507", "stage": "kto", **LORA,
        "pref_beta": 0.1, "dataset": "kto_en_demo", "template": "qwen3_nothink",
        "output_dir": "saves/qwen3-4b/lora/kto", "gradient_accumulation_steps": 8,
        "learning_rate": 5.0e-6,
        **{k: v for k, v in COMMON.items() if k not in ("save_only_model", "resume_from_checkpoint")}},
    "train_lora/qwen3_lora_pretrain.yaml": {
        "model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507", "stage": "pt", **LORA,
        "dataset": "c4_demo", "output_dir": "saves/qwen3-4b/lora/pretrain",
        "gradient_accumulation_steps": 8, "learning_rate": 1.0e-4, **COMMON},
}
# LLaMA-Factory ships no orpo YAML: its README has users switch the dpo example's pref_loss.
EXAMPLES["train_lora/qwen3_lora_dpo.yaml with pref_loss: orpo"] = {
    **EXAMPLES["train_lora/qwen3_lora_dpo.yaml"], "pref_loss": "orpo"}
"""LLaMA-Factory's examples/<name> as a dict each (and the dpo one as its users turn it into orpo)."""

# LLaMA-Factory 0.9.3's llama3 examples (0.9.4 moved its main examples to qwen3): the same keys as
# the qwen3 ones, plus overwrite_cache, with the llama3 template (none for pt). Its dpo and kto
# ones differ from qwen3's in the template alone (tests/test_templates.py covers llama3's).
LLAMA3 = {**COMMON, "overwrite_cache": True, "model_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct"}
LLAMA3_EXAMPLES = {
    "train_lora/llama3_lora_sft.yaml": {
        **LLAMA3, "stage": "sft", **LORA, "dataset": "identity,alpaca_en_demo", "template": "llama3",
        "output_dir": "saves/llama3-8b/lora/sft", "gradient_accumulation_steps": 8,
        "learning_rate": 1.0e-4},
    "train_full/llama3_full_sft.yaml": {
        **LLAMA3, "stage": "sft", "finetuning_type": "full",
        "deepspeed": "examples/deepspeed/ds_z3_config.json", "dataset": "identity,alpaca_en_demo",
        "template": "llama3", "output_dir": "saves/llama3-8b/full/sft",
        "gradient_accumulation_steps": 2, "learning_rate": 1.0e-5},
    "train_lora/llama3_lora_pretrain.yaml": {
        **LLAMA3, "stage": "pt", **LORA, "dataset": "c4_demo",
        "output_dir": "saves/llama3-8b/lora/pretrain", "gradient_accumulation_steps": 8,
        "learning_rate": 1.0e-4},
}
"""LLaMA-Factory 0.9.3's examples/<name> for llama3, as dicts."""
