"""Which Megatron linear layers get LoRA adapters, from ``finetuning.lora_target`` in HF terms.

Pure Python (no torch): checked before the process group comes up, so a ``lora_target`` that
names no module of the model stops every rank with one line before anything is allocated.

Users name modules as transformers does (LLaMA-Factory's ``lora_target``); Megatron fuses
some of them, so one Megatron linear carries several HF adapters:

====================  ===========================================  ========================
HF name               Megatron linear (parallel kind)              adapter (A, B) per
====================  ===========================================  ========================
q_proj, k_proj,       ``self_attention.linear_qkv`` (column)        HF module: its own A, B
v_proj
o_proj                ``self_attention.linear_proj`` (row)          HF module
q_a_proj, q_b_proj,   multi-latent attention's ``linear_q_down_``   HF module
q_proj (no q latent), ``proj``, ``linear_q_up_proj``,
kv_a_proj_with_mqa,   ``linear_q_proj``, ``linear_kv_down_proj``,
kv_b_proj             ``linear_kv_up_proj`` (column)
gate_proj, up_proj    ``mlp.linear_fc1`` (column; dense models)     HF module: its own A, B
down_proj             ``mlp.linear_fc2`` (row; dense models)        HF module
gate_up_proj          experts' ``linear_fc1`` (column; MoE)         expert: one A, one B of 2F
down_proj             experts' ``linear_fc2`` (row; MoE)            expert
====================  ===========================================  ========================

So the trainable parameters equal peft's on the transformers model with the same targets.
transformers (5.x) keeps an MoE layer's experts as two 3-D parameters (``gate_up_proj``,
``down_proj``), which peft adapts through ``target_parameters``: one A and one B per expert
over the fused gate and up rows. An MoE model's dense layers and shared experts take no
adapters: on transformers 5, peft reads ``gate_proj``/``up_proj``/``down_proj`` in the
``target_modules`` of these families (qwen2_moe, glm4_moe, deepseek_v3, ...) as the experts'
pre-fusion names and moves them onto the fused expert weights (doubling gate_up_proj's rank),
so no adapter on those linears would load as it was trained. The MoE router and qwen2_moe's
shared-expert gate are not adapter targets either. ``all`` means every name valid for the
model.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_mca.errors import UserError

__all__ = ["LoraModel", "LoraTargetError", "LoraTargets", "MLA_LINEARS", "resolve_lora_targets",
           "valid_lora_targets"]

QKV_PARTS = ("q_proj", "k_proj", "v_proj")
FC1_PARTS = ("gate_proj", "up_proj")
MLA_LINEARS = {"q_a_proj": "linear_q_down_proj", "q_b_proj": "linear_q_up_proj",
               "q_proj": "linear_q_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
               "kv_b_proj": "linear_kv_up_proj"}
"""Multi-latent attention: HF module -> the Megatron linear (one each) of ``self_attention``."""


@dataclass(frozen=True)
class LoraModel:
    """What of a model decides the LoRA targets it has."""

    is_moe: bool = False
    mla_query_latent: bool | None = None
    """Multi-latent attention: whether queries have a latent (q_a_proj, q_b_proj) or a plain
    q_proj; None: multi-head / grouped-query attention."""

    def attention(self) -> tuple[str, ...]:
        if self.mla_query_latent is None:
            return (*QKV_PARTS, "o_proj")
        query = ("q_a_proj", "q_b_proj") if self.mla_query_latent else ("q_proj",)
        return (*query, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

    def mlp(self) -> tuple[str, ...]:
        return ("gate_up_proj", "down_proj") if self.is_moe else (*FC1_PARTS, "down_proj")


class LoraTargetError(UserError):
    """``finetuning.lora_target`` names no module of the model (one line, the valid names)."""


@dataclass(frozen=True)
class LoraTargets:
    """The adapted HF modules of one model, grouped by the Megatron linear they live on."""

    qkv: tuple[str, ...] = ()
    """Parts of ``linear_qkv`` with adapters, in q, k, v order."""
    mla: tuple[str, ...] = ()
    """Multi-latent attention's adapted HF modules (keys of :data:`MLA_LINEARS`)."""
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
        for hf, linear in MLA_LINEARS.items():
            if megatron_module.endswith(f"self_attention.{linear}"):
                return (hf,) if hf in self.mla else ()
        expert = ".local_experts." in megatron_module
        if megatron_module.endswith("linear_fc1"):
            return ("gate_up_proj",) if expert and self.expert_fc1 else () if expert else self.fc1
        if megatron_module.endswith("linear_fc2"):
            return ("down_proj",) if (self.expert_fc2 if expert else self.fc2) else ()
        return ()

    def hf_modules(self) -> list[str]:
        """peft's ``target_modules`` on the transformers model."""
        names = [*self.qkv, *self.mla, *(["o_proj"] if self.proj else []), *self.fc1]
        return names + (["down_proj"] if self.fc2 else [])

    def hf_parameters(self, moe_prefix: str) -> list[str]:
        """peft's ``target_parameters`` on the transformers model (MoE experts), in the order
        peft nests their wrappers."""
        names = (["gate_up_proj"] if self.expert_fc1 else []) + (["down_proj"] if self.expert_fc2 else [])
        return [f"{moe_prefix}.experts.{name}" for name in names]


def valid_lora_targets(model: LoraModel) -> tuple[str, ...]:
    """The HF names ``lora_target`` may use for ``model`` (besides ``all``)."""
    return (*model.attention(), *model.mlp())


def resolve_lora_targets(names: list[str] | tuple[str, ...], model: LoraModel, *,
                         model_type: str = "") -> LoraTargets:
    """``finetuning.lora_target`` as :class:`LoraTargets`; LoraTargetError (one line naming the
    value and the valid names) for a name no module of this model has."""
    valid = valid_lora_targets(model)
    names = [names] if isinstance(names, str) else names
    wanted = [n.strip() for name in names for n in str(name).split(",") if n.strip()]
    if "all" in wanted:
        wanted = list(valid)
    unknown = [n for n in wanted if n not in valid]
    if unknown or not wanted:
        why = ""
        if model.is_moe and {"gate_proj", "up_proj"} & set(unknown):
            why = (" (its experts keep gate and up in one gate_up_proj weight; dense layers' and "
                   "shared experts' MLPs take no adapters)")
        raise LoraTargetError(f"finetuning.lora_target={list(names)!r} names no module of this "
                              f"{model_type or 'model'}{why}: {', '.join(unknown) or 'nothing'}; "
                              f"valid: all, {', '.join(valid)}")
    chosen = set(wanted)
    mla = model.mla_query_latent is not None
    return LoraTargets(
        qkv=() if mla else tuple(p for p in QKV_PARTS if p in chosen),
        mla=tuple(p for p in MLA_LINEARS if p in chosen) if mla else (),
        proj="o_proj" in chosen,
        fc1=tuple(p for p in FC1_PARTS if p in chosen),
        fc2="down_proj" in chosen and not model.is_moe,
        expert_fc1="gate_up_proj" in chosen,
        expert_fc2="down_proj" in chosen and model.is_moe,
    )
