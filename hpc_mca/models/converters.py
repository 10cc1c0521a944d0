"""Model converters: everything a finetuning type changes about a run, in one object.

``finetuning.finetuning_type`` names one converter in :data:`CONVERTERS`, built once from the
finetuning section (:func:`converter_for`). Every place a run's behaviour depends on what
trains asks it instead of comparing the name:

* the Megatron backend's chunks before DDP wraps them (:meth:`ModelConverter.convert_chunks`;
  called by ``launch.run``), and the standard backend's transformers model
  (:meth:`~ModelConverter.convert_hf_model`; ``standard.model``);
* the export at the end of a run (:meth:`~ModelConverter.export_chunks`,
  :meth:`~ModelConverter.export_hf_model`): full HF weights, a PEFT adapter, or the base with
  the adapters merged in (:attr:`~ModelConverter.can_merge`);
* what a checkpoint records so that a resume can refuse other base weights
  (:meth:`~ModelConverter.resume_record`; ``checkpoint.compat``);
* dpo's reference model: a frozen copy, or the policy's own frozen base with its adapters
  switched off (:attr:`~ModelConverter.reference_is_base`, :meth:`~ModelConverter.adapters_off`,
  :meth:`~ModelConverter.hf_adapters_off`).

The planner keeps its own LoRA arithmetic (``topology``, layer 1, knows no models) and the
config rules validate the ``lora_*`` fields (``config``, layer 2, defines the names).

Imports nothing heavy itself: ``checkpoint.compat`` (which ``hpc-mca resume`` runs on the login
node) and the Slurm planner use it, so torch, peft and Megatron are imported inside the methods
that touch a model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from hpc_mca.config.sections import FinetuningArguments

if TYPE_CHECKING:  # imported lazily, inside the methods that use them
    import torch

__all__ = ["CONVERTERS", "FullFinetuning", "LoraFinetuning", "ModelConverter", "converter_for",
           "trains_adapters_only"]


class ModelConverter:
    """What one finetuning type does to a run. The base class is full fine-tuning (every
    parameter trains, as built): the identity everywhere, and the HF model as the export."""

    name: ClassVar[str] = "full"
    trains_adapters: ClassVar[bool] = False
    """True when only adapters train on a frozen base (the planner's ``lora`` workload)."""
    can_merge: ClassVar[bool] = False
    """Whether a merged export (``training.export_merged_dir``) has anything to merge."""
    reference_is_base: ClassVar[bool] = False
    """dpo: True when the policy with its adapters off is the reference (no second copy)."""

    def __init__(self, finetuning: FinetuningArguments) -> None:
        self.finetuning = finetuning

    # ---- the model that trains ----------------------------------------------------------------

    def convert_chunks(self, chunks: list[torch.nn.Module], *, model_path: str,
                       seed: int) -> list[torch.nn.Module]:
        """This rank's Megatron chunks (weights loaded, before DDP) -> the chunks to train.
        ``model_path``: the HF directory they were built from; ``seed``: the run's seed."""
        return chunks

    def convert_hf_model(self, model: torch.nn.Module, *, model_path: str,
                         seed: int) -> torch.nn.Module:
        """The standard backend's transformers model (float32, on the CPU) -> the model to
        train."""
        return model

    # ---- the export ---------------------------------------------------------------------------

    def export_chunks(self, chunks: list[torch.nn.Module], out: Path, *, model_path: str,
                      merged: bool) -> str:
        """Write the trained Megatron chunks to ``out`` (every rank calls it); what was
        written, for the log line."""
        from hpc_mca.models.export import save_hf_checkpoint

        self._check_merge(merged)
        save_hf_checkpoint(chunks, out, model_path, merge_adapters=merged)
        return "HF model (LoRA merged)" if merged else "HF model"

    def export_hf_model(self, model: torch.nn.Module, out: Path, *, merged: bool) -> str:
        """Write the standard backend's trained model (unwrapped from DDP) to the existing
        directory ``out`` (rank 0); what was written, for the log line."""
        self._check_merge(merged)
        if merged:
            model = copy.deepcopy(model).merge_and_unload()
        _save_hf_weights(model, out)
        return "HF model (LoRA merged)" if merged else "HF model"

    def _check_merge(self, merged: bool) -> None:
        # The config rules refuse export_merged_dir where nothing merges; this guards callers.
        if merged and not self.can_merge:
            raise ValueError(f"finetuning_type {self.name!r} has no adapters to merge")

    # ---- resuming -----------------------------------------------------------------------------

    def resume_record(self, model_path: str) -> dict[str, Any]:
        """Fields for checkpoint.json's training record that a resumed run must match, beyond
        those every run records (compared by ``checkpoint.compat``)."""
        return {}

    # ---- dpo's reference ----------------------------------------------------------------------

    def adapters_off(self, chunks: list[torch.nn.Module]) -> contextlib.AbstractContextManager:
        """Megatron chunks run as their frozen base inside this context (no adapters: as
        they are)."""
        return contextlib.nullcontext()

    def hf_adapters_off(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The standard backend's model runs as its frozen base inside this context (no
        adapters: as it is)."""
        return contextlib.nullcontext()


class FullFinetuning(ModelConverter):
    """Every parameter trains, as built (the base class's behaviour, under its own name)."""

    name: ClassVar[str] = "full"


class LoraFinetuning(ModelConverter):
    """LoRA adapters on the targeted linears (``finetuning.lora_*``), every other parameter
    frozen: Megatron layers in :mod:`.lora`, peft on the transformers model, exported as a
    PEFT adapter (or merged), resumed only onto the same base weights."""

    name: ClassVar[str] = "lora"
    trains_adapters: ClassVar[bool] = True
    can_merge: ClassVar[bool] = True
    reference_is_base: ClassVar[bool] = True

    def convert_chunks(self, chunks: list[torch.nn.Module], *, model_path: str,
                       seed: int) -> list[torch.nn.Module]:
        from hpc_mca.models.lora import apply_lora

        return apply_lora(chunks, self.finetuning, model_path=model_path, seed=seed)

    def convert_hf_model(self, model: torch.nn.Module, *, model_path: str,
                         seed: int) -> torch.nn.Module:
        """peft's LoRA on the modules (and, for MoE experts, the parameters) the targets
        name, each A seeded as the Megatron backend draws it."""
        from peft import LoraConfig, get_peft_model

        from hpc_mca.models.hf_config import read_hf_config
        from hpc_mca.topology.lora import resolve_lora_targets

        ft = self.finetuning
        spec = read_hf_config(model_path)
        targets = resolve_lora_targets(ft.lora_target, is_moe=spec.is_moe)
        parameters = targets.hf_parameters(spec.moe_prefix)
        lora = LoraConfig(r=ft.lora_rank, lora_alpha=ft.lora_alpha, lora_dropout=ft.lora_dropout,
                          target_modules=targets.hf_modules() or None,
                          target_parameters=parameters or None, task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
        _seed_hf_adapters(model, seed)
        return model

    def export_chunks(self, chunks: list[torch.nn.Module], out: Path, *, model_path: str,
                      merged: bool) -> str:
        """The PEFT adapter (with ``merged``: the base with the adapters merged in)."""
        if merged:
            return super().export_chunks(chunks, out, model_path=model_path, merged=merged)
        from hpc_mca.models.adapter_export import save_peft_adapter
        from hpc_mca.models.hf_config import read_hf_config
        from hpc_mca.topology.lora import resolve_lora_targets

        spec = read_hf_config(model_path)
        ft = self.finetuning
        save_peft_adapter(chunks, out, spec, resolve_lora_targets(ft.lora_target, is_moe=spec.is_moe),
                          ft, str(Path(model_path).resolve()))
        return "PEFT adapter"

    def export_hf_model(self, model: torch.nn.Module, out: Path, *, merged: bool) -> str:
        if merged:
            return super().export_hf_model(model, out, merged=merged)
        _save_peft_adapter(model, out)
        return "PEFT adapter"

    def resume_record(self, model_path: str) -> dict[str, Any]:
        """The base model the adapters belong to (a checkpoint holds only the adapters): its
        path, and the fingerprint of its weights that a resume must match."""
        path = str(Path(model_path).resolve())
        return {"base_model": {"path": path, "fingerprint": _fingerprint(path)}}

    def adapters_off(self, chunks: list[torch.nn.Module]) -> contextlib.AbstractContextManager:
        from hpc_mca.models.lora import adapters_disabled

        return adapters_disabled(chunks)

    def hf_adapters_off(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return model.disable_adapter()  # peft's switch


CONVERTERS: dict[str, type[ModelConverter]] = {"full": FullFinetuning, "lora": LoraFinetuning}
"""``finetuning.finetuning_type`` -> its converter (the config accepts exactly these names)."""


def converter_for(finetuning: FinetuningArguments) -> ModelConverter:
    """The converter ``finetuning.finetuning_type`` names, bound to that section."""
    return CONVERTERS[finetuning.finetuning_type](finetuning)


def trains_adapters_only(finetuning: FinetuningArguments) -> bool:
    """Whether only adapters train (the planner's LoRA workload), for a config the rules have
    not checked yet: a name without a converter is not, and the rules will refuse it."""
    converter = CONVERTERS.get(finetuning.finetuning_type)
    return converter is not None and converter.trains_adapters


@functools.cache
def _fingerprint(path: str) -> str:
    # Reading every weight file's header is not free: a run asks once per base directory.
    from hpc_mca.models.checkpoint import weights_fingerprint

    return weights_fingerprint(path)


def _seed_hf_adapters(model: torch.nn.Module, seed: int) -> None:
    """Each A from the Megatron backend's seeded draw for its HF module (B stays zero), so
    both backends start a LoRA run from the same adapters."""
    import torch
    from peft.tuners.lora import LoraLayer

    from hpc_mca.models.lora import initial_a

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                hf_name = name.removeprefix("base_model.model.")
                for a in module.lora_A.values():
                    a.weight.copy_(initial_a(hf_name, *a.weight.shape, seed))


def _save_hf_weights(model: torch.nn.Module, out: Path) -> None:
    """transformers' files, in shards of at most the Megatron backend's size, not
    transformers' 50 GB."""
    from hpc_mca.models.export import DEFAULT_MAX_SHARD_BYTES

    model.save_pretrained(str(out), max_shard_size=DEFAULT_MAX_SHARD_BYTES)


def _save_peft_adapter(model: torch.nn.Module, out: Path) -> None:
    """peft's adapter files, without the model card peft adds: a template of placeholders,
    which the Megatron backend's adapter export does not write (a card already there stays,
    as peft updated it)."""
    card = out / "README.md"
    had_card = card.exists()
    model.save_pretrained(str(out))
    if not had_card:
        card.unlink(missing_ok=True)
