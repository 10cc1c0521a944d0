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
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from hpc_mca.config.sections import FinetuningArguments

if TYPE_CHECKING:  # imported lazily, inside the methods that use them
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel

    from hpc_mca.topology.freeze import FreezeSizing

__all__ = ["CONVERTERS", "FreezeFinetuning", "FullFinetuning", "LoraFinetuning", "ModelConverter", "converter_for",
           "frozen_sizing", "trains_adapters_only"]


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
    adapters: tuple[str, ...] = ()
    """``model.adapter_name_or_path``: PEFT adapters the model starts from (set by
    :func:`converter_for`; only LoRA accepts them, as the config rules say)."""

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
            model = _peft_model(copy.deepcopy(model)).merge_and_unload()
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

    # ---- the planner ----------------------------------------------------------------------------

    def frozen_sizing(self, model_path: str) -> FreezeSizing | None:
        """What trains when only part of the model does (freeze), in the planner's terms;
        None: every parameter (or, with :attr:`trains_adapters`, the adapters only)."""
        return None

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
    """Every parameter trains, as built (the base class's behaviour, under its own name),
    except the parts of a vision-language model its ``freeze_*`` settings keep frozen."""

    name: ClassVar[str] = "full"

    def convert_chunks(self, chunks: list[torch.nn.Module], *, model_path: str,
                       seed: int) -> list[torch.nn.Module]:
        from hpc_mca.models.freeze import freeze_vision_parts

        for chunk in chunks:
            freeze_vision_parts(chunk, self.finetuning)
        return chunks

    def convert_hf_model(self, model: torch.nn.Module, *, model_path: str,
                         seed: int) -> torch.nn.Module:
        from hpc_mca.models.freeze import freeze_vision_parts

        freeze_vision_parts(model, self.finetuning)
        return model


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
        """Adapters given as input first (LLaMA-Factory's order: every one but the last merged
        into the base, the last trained on; all merged under ``create_new_adapter``), then the
        adapter that trains: the last given one (the config rules gave ``finetuning`` its
        rank, alpha and targets) or a fresh one."""
        from hpc_mca.models.adapter_import import load_adapter, merge_adapters, split_adapters
        from hpc_mca.models.hf_config import read_hf_config
        from hpc_mca.models.lora import apply_lora

        merged, resumed = split_adapters(self.adapters, self.finetuning.create_new_adapter)
        merge_adapters(chunks, self.finetuning, merged, model_path=model_path, seed=seed)
        chunks = apply_lora(chunks, self.finetuning, model_path=model_path, seed=seed)
        if resumed is not None:
            load_adapter(chunks, resumed, read_hf_config(model_path))
        return chunks

    def convert_hf_model(self, model: torch.nn.Module, *, model_path: str,
                         seed: int) -> torch.nn.Module:
        """Adapters given as input with peft, as LLaMA-Factory loads them (every one but the
        last merged with ``merge_and_unload``, the last loaded trainable; all merged under
        ``create_new_adapter``); else peft's LoRA on the modules (and, for MoE experts, the
        parameters) the targets name, each A seeded as the Megatron backend draws it."""
        from peft import LoraConfig, PeftModel, get_peft_model

        from hpc_mca.models.adapter_import import split_adapters
        from hpc_mca.models.hf_config import read_hf_config
        from hpc_mca.models.lora import lora_alpha
        from hpc_mca.models.vl_config import LORA_EXCLUDED
        from hpc_mca.topology.lora import resolve_lora_targets

        merged, resumed = split_adapters(self.adapters, self.finetuning.create_new_adapter)
        model = merge_hf_adapters(model, merged)
        if resumed is not None:
            return PeftModel.from_pretrained(model, resumed, is_trainable=True)
        ft = self.finetuning
        spec = read_hf_config(model_path)
        targets = resolve_lora_targets(ft.lora_target, spec.lora_model())
        parameters = targets.hf_parameters(spec.moe_prefix)
        # lora_alpha: peft annotates int but takes any number (scaling = alpha / r).
        lora = LoraConfig(r=ft.lora_rank, lora_alpha=lora_alpha(ft),  # type: ignore[arg-type]
                          lora_dropout=ft.lora_dropout,
                          target_modules=targets.hf_modules() or None,
                          target_parameters=parameters or None, task_type="CAUSAL_LM",
                          exclude_modules=LORA_EXCLUDED if spec.vision is not None else None)
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
        targets = resolve_lora_targets(ft.lora_target, spec.lora_model())
        save_peft_adapter(chunks, out, spec, targets,
                          ft, str(Path(model_path).resolve()))
        return "PEFT adapter"

    def export_hf_model(self, model: torch.nn.Module, out: Path, *, merged: bool) -> str:
        if merged:
            return super().export_hf_model(model, out, merged=merged)
        _save_peft_adapter(model, out)
        return "PEFT adapter"

    def resume_record(self, model_path: str) -> dict[str, Any]:
        """The base model the adapters belong to (a checkpoint holds only the adapters): its
        path, and the fingerprint of its weights that a resume must match. Adapters merged
        into it (``model.adapter_name_or_path``) change it: their fingerprints join the
        base's, and the record names them beside the path."""
        path = str(Path(model_path).resolve())
        fingerprint = _fingerprint(path)
        merged = _merged_adapters(self.adapters, self.finetuning.create_new_adapter)
        if merged:
            digest = hashlib.sha256(fingerprint.encode())
            for adapter in merged:
                digest.update(_adapter_fingerprint(adapter).encode())
            path = f"{path} + merged adapters {', '.join(merged)}"
            fingerprint = digest.hexdigest()
        return {"base_model": {"path": path, "fingerprint": fingerprint}}

    def adapters_off(self, chunks: list[torch.nn.Module]) -> contextlib.AbstractContextManager:
        from hpc_mca.models.lora import adapters_disabled

        return adapters_disabled(chunks)

    def hf_adapters_off(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return _peft_model(model).disable_adapter()  # peft's switch


class FreezeFinetuning(ModelConverter):
    """LLaMA-Factory's partial fine-tuning: the decoder layers and modules
    ``finetuning.freeze_*`` pick train, everything else is frozen (:mod:`.freeze`). Exported
    as the whole HF model (nothing to merge); a Megatron checkpoint holds only the trainable
    parameters, so a resume must find the same base weights; dpo's reference is a frozen copy
    of the starting model (the policy's frozen part alone is not one)."""

    name: ClassVar[str] = "freeze"

    def convert_chunks(self, chunks: list[torch.nn.Module], *, model_path: str,
                       seed: int) -> list[torch.nn.Module]:
        from hpc_mca.models.freeze import freeze_chunks

        return freeze_chunks(chunks, self.finetuning, model_path=model_path)

    def convert_hf_model(self, model: torch.nn.Module, *, model_path: str,
                         seed: int) -> torch.nn.Module:
        from hpc_mca.models.freeze import freeze_hf_model

        return freeze_hf_model(_hf_model(model), self.finetuning)

    def resume_record(self, model_path: str) -> dict[str, Any]:
        """The base model the frozen parameters come from (a Megatron checkpoint holds only
        the trainable ones): its path and the fingerprint a resume must match."""
        path = str(Path(model_path).resolve())
        return {"base_model": {"path": path, "fingerprint": _fingerprint(path),
                               "trained": "the freeze-trained layers"}}

    def frozen_sizing(self, model_path: str) -> FreezeSizing | None:
        from hpc_mca.topology import ModelShape
        from hpc_mca.topology.freeze import freeze_rule, freeze_sizing, hf_parameter_sizes

        ft, shape = self.finetuning, ModelShape.from_hf_config(model_path)
        rule = freeze_rule(hf_parameter_sizes(shape), shape.num_layers, ft.freeze_trainable_layers,
                           ft.freeze_trainable_modules, ft.freeze_extra_modules)
        return freeze_sizing(shape, rule)


CONVERTERS: dict[str, type[ModelConverter]] = {"full": FullFinetuning, "lora": LoraFinetuning,
                                               "freeze": FreezeFinetuning}
"""``finetuning.finetuning_type`` -> its converter (the config accepts exactly these names)."""


def converter_for(finetuning: FinetuningArguments,
                  adapters: list[str] | None = None) -> ModelConverter:
    """The converter ``finetuning.finetuning_type`` names, bound to that section and to the
    adapters the model starts from (``model.adapter_name_or_path``; the model and the resume
    record need them, dpo's reference and the export do not)."""
    converter = CONVERTERS[finetuning.finetuning_type](finetuning)
    converter.adapters = tuple(adapters or ())
    return converter


def frozen_sizing(finetuning: FinetuningArguments, model_path: str | None) -> FreezeSizing | None:
    """The planner's freeze sizing for a config the rules may not have checked yet: None for
    a name without a converter, a missing model or settings the rules will refuse."""
    from hpc_mca.errors import UserError

    converter = CONVERTERS.get(finetuning.finetuning_type)
    if converter is None or not model_path:
        return None
    try:
        return converter(finetuning).frozen_sizing(model_path)
    except (UserError, OSError):
        return None


def merge_hf_adapters(model: torch.nn.Module, paths: list[str] | tuple[str, ...]) -> torch.nn.Module:
    """The transformers ``model`` with the PEFT adapters at ``paths`` merged in, in order, as
    LLaMA-Factory merges them (peft's ``merge_and_unload``)."""
    from peft import PeftModel

    for path in paths:
        model = PeftModel.from_pretrained(model, path).merge_and_unload()
    return model


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


def _merged_adapters(adapters: tuple[str, ...], create_new: bool) -> list[str]:
    """The adapters merged into the base (LLaMA-Factory's split; the same as
    ``adapter_import.split_adapters``, which needs torch)."""
    return list(adapters) if create_new else list(adapters[:-1])


@functools.cache
def _adapter_fingerprint(path: str) -> str:
    """sha256 of an adapter directory's config and weights."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        digest.update((Path(path) / name).read_bytes())
    return digest.hexdigest()


def _seed_hf_adapters(model: torch.nn.Module, seed: int) -> None:
    """Each A from the Megatron backend's seeded draw for its HF module (B stays zero), so
    both backends start a LoRA run from the same adapters."""
    import torch
    from peft.tuners.lora import LoraLayer

    from hpc_mca.models.lora import initial_a, linears
    from hpc_mca.models.vl_config import lora_checkpoint_name

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                # the checkpoint's name, which the Megatron backend draws by (a VL model's
                # language model is under model.language_model here)
                hf_name = lora_checkpoint_name(name.removeprefix("base_model.model."))
                for a in linears(module.lora_A).values():
                    rank, fan_in = a.weight.shape
                    a.weight.copy_(initial_a(hf_name, rank, fan_in, seed))


def _save_hf_weights(model: torch.nn.Module, out: Path) -> None:
    """transformers' files, in shards of at most the Megatron backend's size, not
    transformers' 50 GB."""
    from hpc_mca.models.export import DEFAULT_MAX_SHARD_BYTES

    _hf_model(model).save_pretrained(str(out), max_shard_size=DEFAULT_MAX_SHARD_BYTES)


def _save_peft_adapter(model: torch.nn.Module, out: Path) -> None:
    """peft's adapter files, without the model card peft adds: a template of placeholders,
    which the Megatron backend's adapter export does not write (a card already there stays,
    as peft updated it)."""
    card = out / "README.md"
    had_card = card.exists()
    _peft_model(model).save_pretrained(str(out))
    if not had_card:
        card.unlink(missing_ok=True)


def _hf_model(model: torch.nn.Module) -> PreTrainedModel:
    # The standard backend's model is a transformers one (standard.model loads it so).
    return cast("PreTrainedModel", model)


def _peft_model(model: torch.nn.Module) -> PeftModel:
    # Only LoRA has adapters to merge or switch off, and its model is peft's (convert_hf_model).
    return cast("PeftModel", model)
