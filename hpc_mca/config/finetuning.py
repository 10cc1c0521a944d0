"""The ``finetuning`` section of the run config: the stage and what trains."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_mca.frozen import Freezable

__all__ = ["FinetuningArguments"]


@dataclass
class FinetuningArguments(Freezable):
    """Which training stage runs and which parameters it updates."""

    stage: str = "sft"
    """pt (next-token loss on all tokens), sft (loss on responses) or dpo (preference pairs
    against a frozen reference model)."""
    finetuning_type: str = "full"
    """full (every parameter), lora (adapters on the frozen model, through peft: only they
    train and are checkpointed) or freeze (the layers and modules ``freeze_*`` pick train, as
    LLaMA-Factory's rule picks them; the rest is frozen; exported as the whole model)."""
    lora_rank: int = 8
    """LoRA rank r."""
    lora_alpha: float | None = None
    """LoRA scaling numerator; None = 2 * lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_target: list[str] = field(default_factory=lambda: ["all"])
    """HF module names that get adapters (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj; MoE experts: gate_up_proj, down_proj), or ``all`` (every one the model has; the
    MoE router is never adapted). A comma-separated string works too."""
    pref_beta: float = 0.1
    """dpo and kto: β, how far the policy may move from the reference (the rewards' scale)."""
    pref_loss: str = "sigmoid"
    """dpo: sigmoid (DPO), ipo (on per-token mean log-ratios), hinge, or the reference-free
    orpo (odds ratio, weight pref_beta, plus the chosen answer's mean token NLL) and simpo
    (margin simpo_gamma), both on per-token mean log-probabilities as LLaMA-Factory's."""
    dpo_label_smoothing: float = 0.0
    """dpo with sigmoid: the assumed rate of flipped preference labels (cDPO), in [0, 0.5)."""
    pref_ftx: float = 0.0
    """dpo: weight of an SFT term, the chosen answer's mean token NLL, added to each pair."""
    simpo_gamma: float = 0.5
    """dpo with pref_loss simpo: the target reward margin γ (LLaMA-Factory's default)."""
    use_ref_model: bool | None = None
    """dpo: whether a reference model scores the pairs. None = what the loss needs (sigmoid,
    ipo, hinge: yes; orpo, simpo: no, they are reference-free); false with sigmoid, ipo or
    hinge = TRL's ``reference_free`` (the reference log-probabilities are 0), and no reference
    model is built."""
    ref_model: str | None = None
    """dpo: an HF model directory to use as the reference instead of the starting model (of
    the policy's family and shape; built in the policy's layout; under LoRA too, instead of
    the policy with its adapters off)."""
    ref_model_adapters: list[str] | None = None
    """dpo: PEFT LoRA adapter directories merged, in order, onto the reference model
    ``ref_model`` (LLaMA-Factory's ``create_ref_model``: read only with ``ref_model``, which
    may name the policy's own model directory; refused without it)."""
    kto_chosen_weight: float = 1.0
    """kto: weight of the desirable examples' losses (TRL's ``desirable_weight``)."""
    kto_rejected_weight: float = 1.0
    """kto: weight of the undesirable examples' losses (TRL's ``undesirable_weight``)."""
    freeze_trainable_layers: int = 2
    """freeze: decoder layers that train, the last N when positive, the first -N when
    negative, counted over the whole model (LLaMA-Factory's rule); 0 < |N| <= the model's
    layers."""
    freeze_trainable_modules: list[str] = field(default_factory=lambda: ["all"])
    """freeze: the modules of those layers that train (HF names directly below a layer:
    self_attn, mlp, input_layernorm, post_attention_layernorm), or ``all``; a comma-separated
    string works too. Parts (q_proj...) are refused: Megatron fuses them."""
    freeze_extra_modules: list[str] | None = None
    """freeze: modules outside the decoder layers that train too (HF names: embed_tokens,
    norm, lm_head when not tied); None = none. As in LLaMA-Factory a parameter trains when the
    name is part of its name, so ``norm`` also trains every layer's norms."""
    create_new_adapter: bool = False
    """lora with ``model.adapter_name_or_path``: merge the given adapters into the base and
    train a fresh adapter on top (true), or train the last given adapter further (false)."""
    freeze_vision_tower: bool = True
    """Vision-language models: the vision encoder (patch embedding and blocks) stays frozen
    (LLaMA-Factory's default). false trains it with ``finetuning_type: full``."""
    freeze_multi_modal_projector: bool = True
    """Vision-language models: the merger that projects vision features into the language
    model stays frozen (LLaMA-Factory's default). false trains it with ``finetuning_type: full``."""
    freeze_language_model: bool = False
    """Vision-language models with ``finetuning_type: full``: true trains the vision side only
    (the language model, its embeddings and output layer stay frozen)."""
