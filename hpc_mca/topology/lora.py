"""Which Megatron linear layers get LoRA adapters, from ``finetuning.lora_target`` in HF terms.

Pure Python (no torch): checked before the process group comes up, so a ``lora_target`` that
names no module of the model stops every rank with one line before anything is allocated.

Users name modules as transformers does (LLaMA-Factory's ``lora_target``); Megatron fuses
some of them, so one Megatron linear carries several HF adapters:

====================  =========================================  ==========================
HF name               Megatron linear (parallel kind)            adapter (A, B) per
====================  =========================================  ==========================
q_proj, k_proj,       ``self_attention.linear_qkv`` (column)      HF module: its own A and B
v_proj
o_proj                ``self_attention.linear_proj`` (row)        HF module
gate_proj, up_proj    ``mlp.linear_fc1`` (column; dense models)   HF module: its own A and B
down_proj             ``mlp.linear_fc2`` (row; dense models)      HF module
gate_up_proj          experts' ``linear_fc1`` (column; MoE)       expert: one A, one B of 2F
down_proj             experts' ``linear_fc2`` (row; MoE)          expert
====================  =========================================  ==========================

So the trainable parameters equal peft's on the transformers model with the same targets.
transformers (5.x) keeps an MoE layer's experts as two 3-D parameters (``gate_up_proj``,
``down_proj``), which peft adapts through ``target_parameters``: one A and one B per expert
over the fused gate and up rows; the MoE router is not an adapter target. ``all`` means every
name valid for the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_mca.errors import UserError

__all__ = ["LoraTargetError", "LoraTargets", "resolve_lora_targets", "valid_lora_targets"]

QKV_PARTS = ("q_proj", "k_proj", "v_proj")
FC1_PARTS = ("gate_proj", "up_proj")
_DENSE = (*QKV_PARTS, "o_proj", *FC1_PARTS, "down_proj")
_MOE = (*QKV_PARTS, "o_proj", "gate_up_proj", "down_proj")


class LoraTargetError(UserError):
    """``finetuning.lora_target`` names no module of the model (one line, the valid names)."""


@dataclass(frozen=True)
class LoraTargets:
    """The adapted HF modules of one model, grouped by the Megatron linear they live on."""

    qkv: tuple[str, ...] = ()
    """Parts of ``linear_qkv`` with adapters, in q, k, v order."""
    proj: bool = False
    """``o_proj`` on ``linear_proj``."""
    fc1: tuple[str, ...] = ()
    """Parts of a dense ``linear_fc1`` (gate_proj, up_proj)."""
    fc2: bool = False
    """A dense ``down_proj`` on ``linear_fc2``."""
    expert_fc1: bool = False
    """Every expert's ``linear_fc1`` (HF ``gate_up_proj``)."""
    expert_fc2: bool = False
    """Every expert's ``linear_fc2`` (HF ``down_proj``)."""

    def parts(self, megatron_module: str) -> tuple[str, ...]:
        """The HF names adapted on a Megatron linear, by its name inside a layer
        (``self_attention.linear_qkv``, ``mlp.local_experts.3.linear_fc1``, ...); () for none."""
        if megatron_module.endswith("self_attention.linear_qkv"):
            return self.qkv
        if megatron_module.endswith("self_attention.linear_proj"):
            return ("o_proj",) if self.proj else ()
        expert = ".local_experts." in megatron_module
        if megatron_module.endswith("linear_fc1"):
            return ("gate_up_proj",) if expert and self.expert_fc1 else () if expert else self.fc1
        if megatron_module.endswith("linear_fc2"):
            return ("down_proj",) if (self.expert_fc2 if expert else self.fc2) else ()
        return ()

    def hf_modules(self) -> list[str]:
        """peft's ``target_modules`` on the transformers model."""
        names = [*self.qkv, *(["o_proj"] if self.proj else []), *self.fc1]
        return names + (["down_proj"] if self.fc2 else [])

    def hf_parameters(self, moe_prefix: str) -> list[str]:
        """peft's ``target_parameters`` on the transformers model (MoE experts), in the order
        peft nests their wrappers."""
        names = (["gate_up_proj"] if self.expert_fc1 else []) + (["down_proj"] if self.expert_fc2 else [])
        return [f"{moe_prefix}.experts.{name}" for name in names]


_ATTENTION = (*QKV_PARTS, "o_proj")


def valid_lora_targets(is_moe: bool, mixed_mlp: bool = False) -> tuple[str, ...]:
    """The HF names ``lora_target`` may use for a dense or an MoE model (besides ``all``);
    ``mixed_mlp``: an MoE model that also has dense-MLP layers or shared experts, where only
    attention takes adapters so far (their MLP modules share names with the experts')."""
    if mixed_mlp:
        return _ATTENTION
    return _MOE if is_moe else _DENSE


def resolve_lora_targets(names: list[str] | tuple[str, ...], *, is_moe: bool,
                         model_type: str = "", mixed_mlp: bool = False) -> LoraTargets:
    """``finetuning.lora_target`` as :class:`LoraTargets`; LoraTargetError (one line naming the
    value and the valid names) for a name no module of this model has or takes adapters on."""
    valid = valid_lora_targets(is_moe, mixed_mlp)
    names = [names] if isinstance(names, str) else names
    wanted = [n.strip() for name in names for n in str(name).split(",") if n.strip()]
    if "all" in wanted:
        wanted = list(valid)
    unknown = [n for n in wanted if n not in valid]
    if unknown or not wanted:
        why = ""
        if mixed_mlp:
            why = (" that takes adapters here (MLP adapters on a model with dense layers or "
                   "shared experts besides its experts are not supported yet)")
        elif is_moe and {"gate_proj", "up_proj"} & set(unknown):
            why = " (its experts keep gate and up in one gate_up_proj weight)"
        raise LoraTargetError(f"finetuning.lora_target={list(names)!r} names no module of this "
                          f"{model_type or 'model'}{why}: {', '.join(unknown) or 'nothing'}; "
                          f"valid: all, {', '.join(valid)}")
    chosen = set(wanted)
    return LoraTargets(
        qkv=tuple(p for p in QKV_PARTS if p in chosen),
        proj="o_proj" in chosen,
        fc1=tuple(p for p in FC1_PARTS if p in chosen),
        fc2="down_proj" in chosen and not is_moe,
        expert_fc1="gate_up_proj" in chosen,
        expert_fc2="down_proj" in chosen and is_moe,
    )
