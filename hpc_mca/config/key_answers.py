"""One answer for every key of LLaMA-Factory 0.9.5's argument classes (ModelArguments,
DataArguments, FinetuningArguments, TrainingArguments) and transformers'
``Seq2SeqTrainingArguments``:

- honoured: a field of this config under the same name and meaning (found in the config's own
  field index, :func:`hpc_mca.config.sections.field_section`, never listed here);
- translated: :data:`hpc_mca.config.lf_keys.LF_KEYS` sets this config's fields from it;
- refused (:data:`REFUSED`): its default value (what a YAML copied from LLaMA-Factory carries)
  is accepted and sets nothing, since that default is what runs here; any other value is refused
  in one line naming the key, the value and what replaces it.

The loader (:mod:`.loading`) asks :func:`refusal` before it calls a key unknown;
:func:`readme_table` renders the table of docs/llama-factory-keys.md from these tables (the
page gives the command that prints it), and tests/test_key_answers.py walks the
classes' fields against :func:`answer`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .input import KNOWN_ELSEWHERE
from .lf_keys import LF_KEY_NOTES, LF_KEYS
from .sections import field_section

__all__ = ["FAMILIES", "REFUSED", "Family", "answer", "readme_table", "refusal", "refused_name"]


@dataclass(frozen=True)
class Family:
    """Keys refused for one reason: each name with the default that is accepted."""

    why: str
    """What replaces them here (one line, no trailing period)."""
    defaults: dict[str, object]
    """Key -> its default in LLaMA-Factory / transformers, the one value accepted (it sets
    nothing: it is what runs here)."""


_NOTHING_DOWNLOADED = ("nothing is downloaded or uploaded here: models and datasets are local "
                       "paths (model_name_or_path, data.dataset / data.dataset_dir)")
_MEDIA = ("videos and audios are not supported (images are: data.image_max_pixels, data.image_min_pixels, "
          "data.media_dir with a vision-language template)")
_INFERENCE = ("hpc-mca trains; it has no inference engine: serve the exported HF model "
              "(training.export_hf_dir) with one")
_OPTIMIZERS = "training.optim: adam or sgd (parallel.use_distributed_optimizer shards its state)"
_EVAL = "evaluation reports the eval loss (and the stage's own metrics); no compute_metrics hooks"
_LAYOUT = ("Megatron-Core's parallelism replaces it: the parallel section (data/tensor/pipeline/"
           "context/expert parallel sizes, use_distributed_optimizer); ranks start from Slurm's job")

FAMILIES: tuple[Family, ...] = (
    Family("adapters are read from model.adapter_name_or_path (directories with "
           "adapter_config.json)", {"adapter_folder": None}),
    Family(_NOTHING_DOWNLOADED,
           {"cache_dir": None, "model_revision": "main", "hf_hub_token": None, "ms_hub_token": None,
            "om_hub_token": None}),
    Family(_NOTHING_DOWNLOADED + "; training.export_hf_dir writes the HF model to upload",
           {"push_to_hub": False, "hub_token": None, "hub_private_repo": None, "hub_model_id": None,
            "hub_strategy": "every_save", "hub_always_push": False, "hub_revision": None}),
    Family("the tokenizer is transformers' fast tokenizer "
           "of model_name_or_path (or model.tokenizer_name_or_path), special tokens in text tokenized "
           "as special tokens", {"use_fast_tokenizer": True, "split_special_tokens": False}),
    Family("the model directory's tokenizer is used as saved: add tokens to it (and its embeddings) "
           "before training", {"add_tokens": None, "add_special_tokens": None,
                               "new_special_tokens_config": None, "init_special_tokens": "noise_init"}),
    Family("each rank always loads only its own shard of the weights",
           {"low_cpu_mem_usage": True}),
    Family("RoPE scaling is the model's config.json rope_scaling (edit it there)",
           {"rope_scaling": None}),
    Family("no shifted sparse attention (LongLoRA); long sequences: "
           "parallel.context_parallel_size", {"shift_attn": False}),
    Family("no mixture-of-depths conversion here", {"mixture_of_depths": None}),
    Family("Megatron-Core's kernels "
           "and model.fusions (the compiled fusions) replace them",
           {"use_unsloth": False, "use_unsloth_gc": False, "use_v1_kernels": False, "torch_compile": False,
            "torch_compile_backend": None, "torch_compile_mode": None}),
    Family("liger-kernel is not used here (see enable_liger_kernel); model.fusions "
           "chooses the compiled kernels", {"liger_kernel_config": None}),
    Family("the load-balancing loss weight is the model's router_aux_loss_coef "
           "(its config.json)", {"moe_aux_loss_coef": None}),
    Family("recomputation is gradient_checkpointing or parallel.recompute_granularity/method/num_layers/"
           "modules", {"use_reentrant_gc": True, "gradient_checkpointing_kwargs": None,
                       "activation_checkpointing": None, "activation_checkpointing_kwargs": None}),
    Family("precision is training.bf16 / training.fp16 (bf16 keeps fp32 master weights; evaluation runs "
           "in the training dtype)", {"upcast_layernorm": False, "upcast_lmhead_output": False,
                                      "pure_bf16": False, "bf16_full_eval": False, "fp16_full_eval": False,
                                      "tf32": None}),
    Family("no fp8 training here (bf16 or fp16 with fp32 master weights)",
           {"fp8": False, "fp8_backend": "auto", "fp8_enable_fsdp_float8_all_gather": False}),
    Family("a model directory without *.safetensors (config.json only) starts from "
           "random weights", {"train_from_scratch": False}),
    Family(_INFERENCE, {"infer_backend": "huggingface", "offload_folder": "offload", "use_kv_cache": True,
                        "infer_dtype": "auto", "vllm_maxlen": 4096, "vllm_gpu_util": 0.7,
                        "vllm_enforce_eager": False, "vllm_max_lora_rank": 32, "vllm_config": None,
                        "sglang_maxlen": 4096, "sglang_mem_fraction": 0.7, "sglang_tp_size": -1,
                        "sglang_config": None, "sglang_lora_backend": "triton", "use_kt": False,
                        "kt_weight_path": None, "kt_expert_checkpoint_path": None,
                        "kt_use_lora_experts": None, "kt_lora_expert_num": None,
                        "kt_lora_expert_intermediate_size": None}),
    Family("no per-parameter listing: finetuning_type and its settings decide what trains",
           {"print_param_status": False}),
    Family(KNOWN_ELSEWHERE["quantization_bit"],
           {"quantization_method": "bnb", "quantization_bit": None, "quantization_type": "nf4",
            "double_quantization": True, "quantization_device_map": None,
            "ref_model_quantization_bit": None}),
    Family(_MEDIA,
           {"image_do_pan_and_scan": False,
            "crop_to_patches": False, "video_max_pixels": 65536, "video_min_pixels": 256,
            "video_fps": 2.0, "video_maxlen": 128, "use_audio_in_video": False,
            "audio_sampling_rate": 16000}),
    Family("LLaMA-Factory's export stage: use hpc-mca export (a run's checkpoint -> an HF directory, "
           "unquantized; training.export_hf_dir / export_merged_dir write one after the last step)",
           {"export_size": 5, "export_device": "cpu", "export_quantization_bit": None,
            "export_quantization_dataset": None, "export_quantization_nsamples": 128,
            "export_quantization_maxlen": 1024, "export_legacy_format": False, "export_hub_model_id": None}),
    Family("no streaming: datasets are tokenized once and read whole (data.data_path for "
           "a corpus too large for that)", {"buffer_size": 16384}),
    Family("tokenization runs sample by sample; data.preprocessing_num_workers "
           "sets its processes", {"preprocessing_batch_size": 1000}),
    Family("padding is never in the loss here", {"ignore_pad_token_for_loss": True}),
    Family("the eval datasets are evaluated as one set (one eval loss)",
           {"eval_on_each_dataset": False}),
    Family("reasoning templates drop earlier answers' thoughts from the prompt, as "
           "LLaMA-Factory's default does (data.enable_thinking / data.mask_history choose the rest)",
           {"preserve_thinking": False}),
    Family("datasets are tokenized into the cache "
           "data.preprocessing_cache_dir names (put it on a shared file system to tokenize once)",
           {"data_shared_file_system": False}),
    Family("LoRA adapts the decoder layers' linears (finetuning.lora_target); no "
           "modules_to_save", {"additional_target": None}),
    Family("no OFT here: finetuning_type lora, freeze or full",
           {"oft_rank": 0, "oft_block_size": 32, "oft_target": "all", "module_dropout": 0.0}),
    Family("no LoRA+: every adapter trains at "
           "training.learning_rate", {"loraplus_lr_ratio": None, "loraplus_lr_embedding": 1e-06}),
    Family("no rank-stabilised LoRA: adapters are scaled by lora_alpha / lora_rank",
           {"use_rslora": False}),
    Family("no DoRA here: finetuning_type lora trains plain LoRA adapters", {"use_dora": False}),
    Family("no PiSSA initialisation: adapters start as peft's default (A random, B zero)",
           {"pissa_init": False, "pissa_iter": 16, "pissa_convert": False}),
    Family("dpo's loss is finetuning.pref_loss (sigmoid, ipo, hinge, orpo, "
           "simpo) with pref_ftx; no BCO term or LD-DPO length weighting",
           {"pref_bco_weight": 0.0, "ld_alpha": None}),
    Family("stages ppo and rm are not available here: finetuning.stage pt, sft, dpo "
           "or kto", {"ppo_buffer_size": 1, "ppo_epochs": 4, "ppo_score_norm": False, "ppo_target": 6.0,
                      "ppo_whiten_rewards": False, "reward_model": None, "reward_model_adapters": None,
                      "reward_model_quantization_bit": None, "reward_model_type": "lora"}),
    Family(_OPTIMIZERS,
           {"use_galore": False, "galore_target": "all", "galore_rank": 16, "galore_update_interval": 200,
            "galore_scale": 2.0, "galore_proj_type": "std", "galore_layerwise": False,
            "optim_target_modules": None}),
    Family(_OPTIMIZERS,
           {"use_apollo": False, "apollo_target": "all", "apollo_rank": 16, "apollo_update_interval": 200,
            "apollo_scale": 32.0, "apollo_proj": "random", "apollo_proj_type": "std",
            "apollo_scale_type": "channel", "apollo_layerwise": False, "apollo_scale_front": False}),
    Family(_OPTIMIZERS,
           {"use_badam": False, "badam_mode": "layer", "badam_start_block": None,
            "badam_switch_mode": "ascending", "badam_switch_interval": 50, "badam_update_ratio": 0.05,
            "badam_mask_mode": "adjacent", "badam_verbose": 0}),
    Family(_OPTIMIZERS + "; its settings are adam_beta1/2, "
           "adam_epsilon, weight_decay", {"use_adam_mini": False, "use_muon": False, "optim_args": None}),
    Family("SwanLab is not a tracker here: training.report_to tensorboard, "
           "wandb or mlflow", {"use_swanlab": False, "swanlab_project": "llamafactory",
                               "swanlab_workspace": None, "swanlab_run_name": None, "swanlab_mode": "cloud",
                               "swanlab_api_key": None, "swanlab_logdir": None,
                               "swanlab_lark_webhook_url": None, "swanlab_lark_secret": None}),
    Family("trackers name the run after output_dir's last directory "
           "(W&B's project: WANDB_PROJECT); Trackio is not a tracker here",
           {"run_name": None, "project": "huggingface", "trackio_space_id": None, "trackio_bucket_id": None,
            "trackio_static_space_id": None}),
    Family(_LAYOUT, {"use_hyper_parallel": False, "hyper_parallel_args": None, "ray_num_workers": 1,
                     "ray_init_kwargs": None, "master_addr": None, "master_port": None, "fsdp": None,
                     "fsdp_config": None, "accelerator_config": None, "parallelism_config": None,
                     "ddp_find_unused_parameters": None, "ddp_bucket_cap_mb": None,
                     "ddp_broadcast_buffers": None, "ddp_static_graph": None, "ddp_backend": None,
                     "local_rank": -1, "use_cpu": False, "debug": ""}),
    Family("sft's loss is the cross-entropy averaged over the global "
           "batch's trained tokens (parallel.calculate_per_token_loss); dpo's label smoothing: "
           "finetuning.dpo_label_smoothing",
           {"use_dft_loss": False, "use_asft_loss": False, "asft_alpha": 0.1, "use_eaft_loss": False,
            "eaft_alpha": 1.0, "label_smoothing_factor": 0.0, "average_tokens_across_devices": True}),
    Family("no NEFTune noise on the embeddings here", {"neftune_noise_alpha": None}),
    Family(_EVAL,
           {"compute_accuracy": False, "prediction_loss_only": False, "eval_do_concat_batches": True,
            "eval_use_gather_object": False, "eval_accumulation_steps": None, "include_for_metrics": [],
            "batch_eval_metrics": False}),
    Family("no generation: hpc-mca "
           "trains and evaluates the loss (serve the exported model to generate)",
           {"predict_with_generate": False, "generation_max_length": None, "generation_num_beams": None,
            "generation_config": None, "eval_num_beams": None, "do_predict": False}),
    Family(KNOWN_ELSEWHERE["do_eval"],
           {"do_eval": False}),
    Family("evaluation runs every training.eval_steps and after the last step",
           {"eval_delay": 0, "eval_on_start": False}),
    Family(KNOWN_ELSEWHERE["use_llama_pro"], {"use_llama_pro": False}),
    Family("training rows are shuffled, seeded by training.seed (a resume continues the same order)",
           {"disable_shuffling": False, "data_seed": None, "train_sampling_strategy": "random",
            "sortish_sampler": False}),
    Family("no early stopping or best-model selection: the run ends at training.max_steps / "
           "num_train_epochs and exports the last step's model",
           {"early_stopping_steps": None, "load_best_model_at_end": False, "metric_for_best_model": None,
            "greater_is_better": None}),
    Family("the run log and "
           "steps.jsonl report tokens per second (perf/tokens_per_s) and each step's tokens",
           {"include_effective_tokens_per_second": False, "include_num_input_tokens_seen": "no"}),
    Family("no KV cache in training", {"use_cache": False}),
    Family("the CUDA cache is not emptied on an interval",
           {"torch_empty_cache_steps": None}),
    Family("the batch size is fixed: hpc-mca plan sizes the layout and batch "
           "before submission", {"auto_find_batch_size": False}),
    Family("rank 0 writes the run log every training.logging_steps steps and the last "
           "(non-finite steps are skipped and counted there)",
           {"logging_first_step": False, "log_on_each_node": True, "logging_nan_inf_filter": True,
            "log_level": "passive", "log_level_replica": "warning", "disable_tqdm": None}),
    Family("checkpoints are written once, by their shards' ranks, to output_dir on the "
           "shared file system", {"save_on_each_node": False}),
    Family("a resume continues the data where "
           "it stopped (the sampler's position is in the checkpoint); callbacks keep no checkpointed state",
           {"ignore_data_skip": False, "restore_callback_states_from_checkpoint": False}),
    Family("training.seed seeds the run; no deterministic-algorithms mode",
           {"full_determinism": False}),
    Family("the loaders are hpc-mca's (every row of an epoch trained, its last step a partial global "
           "batch, as with drop_last false); their settings are training.dataloader_num_workers and "
           "dataloader_prefetch_factor", {"dataloader_drop_last": False, "dataloader_pin_memory": True,
                                          "dataloader_persistent_workers": False,
                                          "dataloader_multiprocessing_context": None,
                                          "dataloader_in_order": True}),
    Family("rows are hpc-mca's tokenized "
           "samples (input ids, labels): there are no columns to choose",
           {"remove_unused_columns": True, "label_names": None, "length_column_name": "length"}),
    Family("no memory metrics are recorded here (hpc-mca plan estimates memory per rank)",
           {"skip_memory_metrics": True}),
    Family("use training.profile_steps: [first, last] "
           "(torch.profiler traces of those steps in output_dir/profile/)",
           {"enable_torch_profiler": False, "profiler_output_dir": None, "profiler_wait_steps": 1,
            "profiler_warmup_steps": 1, "profiler_active_steps": 1, "profiler_repeat": 1,
            "profiler_record_shapes": True, "profiler_profile_memory": True, "profiler_with_stack": True,
            "profile_modules": None}),
)
"""The refused keys, grouped by what replaces them."""

REFUSED: dict[str, Family] = {name: family for family in FAMILIES for name in family.defaults}
"""A refused key -> its family."""


def answer(name: str) -> tuple[str, str] | None:
    """``(kind, what it is here)`` for another tool's key: honoured, translated or refused;
    None for a name with no answer."""
    dotted = field_section(name)
    if dotted is not None:
        return "honoured", dotted
    if name in LF_KEYS:
        return "translated", LF_KEY_NOTES.get(name, ", ".join(LF_KEYS[name].sets) or "accepted")
    if name in REFUSED:
        return "refused", REFUSED[name].why
    return None


def refused_name(key: str, sections: tuple[str, ...]) -> str | None:
    """The refused key that ``key`` names (flat, or under one of ``sections``), or None."""
    section, _, name = key.rpartition(".")
    if key in REFUSED:
        return key
    if section in sections and name in REFUSED and field_section(name) is None:
        return name
    return None


def _same(value: object, default: object) -> bool:
    if default == "no" and value is False:
        return True  # YAML reads a bare `no` as false
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(default, (int, float)) and isinstance(value, (int, float, str)):
        try:
            return float(value) == float(default)
        except ValueError:
            return False
    return value == default


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) and not value else str(value)


def refusal(name: str, value: object) -> str | None:
    """None when ``value`` is the refused key's default (accepted: it sets nothing), else the one
    line refusing it."""
    family = REFUSED[name]
    default = family.defaults[name]
    if _same(value, default):
        return None
    return f"{name}={value!r} is not supported: {family.why}; valid: {_yaml(default)} (its default), or remove the key"


def readme_table() -> str:
    """docs/llama-factory-keys.md's table: this config's own fields, then every translated and refused key."""
    rows = ["| key | answer | what to use |", "|---|---|---|",
            "| every field of this config under its own name (`cutoff_len`, `learning_rate`, `lora_rank`, "
            "`output_dir`, ...: `hpc_mca/config/sections.py`) | honoured | the same meaning |"]
    for name, spec in LF_KEYS.items():
        note = LF_KEY_NOTES.get(name) or ", ".join(f"`{dotted}`" for dotted in spec.sets)
        rows.append(f"| `{name}` | translated | {note} |")
    for family in FAMILIES:
        keys = ", ".join(f"`{key}: {_yaml(value)}`" for key, value in family.defaults.items())
        rows.append(f"| {keys} | refused unless the value shown (the default) | {family.why} |")
    return "\n".join(rows) + "\n"
