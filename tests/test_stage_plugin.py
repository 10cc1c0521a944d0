"""A stage is its module plus its registry row (ARCHITECTURE.md, "Where do I add… A stage").

A throwaway stage is written into the test's directory as one module, outside the package: its
objective for each backend and its row, which the module registers (:func:`hpc_mca.stages.
register`) when imported. Its loss is sft's next-token cross entropy with each answer token
weighted (3 where the label's token id is odd, 1 otherwise): the weighted mean over the global
batch. The run names the module's file in ``HPC_MCA_STAGE_MODULES`` (a module name on
PYTHONPATH does as well: the in-process tests import it so), sets ``finetuning.stage`` to the
row's name and trains a few steps on the tiny CPU model and
the bundled addition data, on either backend; nothing of hpc_mca is edited. Every logged loss
(and the weight sum logged as the step's count) equals an independent computation:
transformers' model on the micro-batches the run's loader gives each step, the weighted cross
entropy computed here and torch's Adam steps between (the run's settings: constant LR, no
clipping, no weight decay). Were the row ignored, the config would refuse the stage; were its
objective not the one that ran, the losses would be plain cross entropy, which the test shows
to differ.
"""

from __future__ import annotations

import itertools
import sys

import pytest
from trainer_fixtures import make_model_dir, make_sft_data, rank_env, run_ranks, steps, write_config

from hpc_mca.stages import (
    CONVERSATION,
    CONVERSATION_DATA_KEYS,
    PLUGINS_ENV,
    STAGE_NAMES,
    STAGES,
    Stage,
    get_stage,
    register,
    unregister,
)

NAME, MODULE = "weighted_sft", "throwaway_stage"
WEIGHT, STEPS, LR, TOLERANCE = 3.0, 3, 1e-3, 1e-5

PLUGIN = f'''
"""A throwaway stage: sft's rows, each answer token's cross entropy weighted by {WEIGHT} where
its label's token id is odd (1 otherwise); the loss is the weighted mean over the global batch."""

from functools import partial

import torch
import torch.nn.functional as F

from hpc_mca.stages import CONVERSATION, CONVERSATION_DATA_KEYS, Stage, register
from hpc_mca.standard.trainer import StandardTrainer, batch_count
from hpc_mca.trainer.objective import Objective
from hpc_mca.trainer.step import model_inputs

WEIGHT = {WEIGHT}


def token_weights(labels, mask):
    return mask * torch.where(labels % 2 == 1, WEIGHT, 1.0)


def weighted_loss(weights, per_token):
    """Megatron's per-token contract with weights for the mask: (weighted sum, weight sum)."""
    weights = weights.reshape(-1).float()
    total = (per_token.float().reshape(-1) * weights).sum()
    count = weights.sum()
    return total, count.to(torch.int), {{"lm loss": torch.stack([total.detach(), count.detach()])}}


class WeightedObjective(Objective):
    """The Megatron backend's: the model's per-token loss, weighted."""

    name = "{NAME}"

    def forward_step(self):
        device = self.ctx.device

        def forward_step(data_iterator, model):
            inputs = model_inputs(next(data_iterator), device)
            output = model(inputs["input_ids"], inputs["position_ids"], None, labels=inputs["labels"],
                           loss_mask=inputs["loss_mask"], packed_seq_params=inputs["packed_seq_params"])
            return output, partial(weighted_loss, token_weights(inputs["labels"], inputs["loss_mask"]))

        return forward_step


class WeightedTrainer(StandardTrainer):
    """The standard backend's: the step's count is the weight sum, the loss the weighted sum."""

    def count_items(self, batch_samples):
        return float(sum(float(token_weights(b["labels"], (b["labels"] != -100).float()).sum())
                         for b in batch_samples))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
        labels = inputs["labels"].flatten()
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels, ignore_index=-100,
                                    reduction="none")
        loss_sum = (per_token * token_weights(labels, (labels != -100).float())).sum()
        self.tally.loss_sum += float(loss_sum.detach())
        loss = loss_sum * (self.run.world_size / batch_count(num_items_in_batch))
        return (loss, logits) if return_outputs else loss


register(Stage("{NAME}", CONVERSATION, 1, reference_model=False, extra_forwards=0,
               data_keys=CONVERSATION_DATA_KEYS, exact_match=False,
               megatron=f"{{__name__}}:WeightedObjective", standard=f"{{__name__}}:WeightedTrainer"))
'''


@pytest.fixture
def plugin_dir(tmp_path):
    (tmp_path / f"{MODULE}.py").write_text(PLUGIN)
    return tmp_path


@pytest.fixture
def imported(plugin_dir, monkeypatch):
    """The plugin imported here as the registry imports it (named by the variable), its row
    removed afterwards."""
    monkeypatch.syspath_prepend(str(plugin_dir))
    monkeypatch.setenv(PLUGINS_ENV, MODULE)
    assert NAME in STAGE_NAMES  # reading the registry imported the module
    yield sys.modules[MODULE]
    unregister(NAME)
    sys.modules.pop(MODULE, None)


def test_the_registry_reads_the_plugin_row_everywhere(imported):
    """The row is in every reader's view: names, rows, the objective table, the config's
    stage rule and its scope (sft's data settings act for it; pt's and dpo's do not)."""
    from hpc_mca.config.rules import _check_stage
    from hpc_mca.config.scope import check_scopes
    from hpc_mca.config.sections import ConfigError, TrainConfig
    from hpc_mca.trainer.stages import OBJECTIVES

    assert STAGE_NAMES[-1] == NAME and STAGES[-1] is get_stage(NAME)
    assert OBJECTIVES[NAME] is imported.WeightedObjective and NAME in OBJECTIVES
    config = TrainConfig()
    config.finetuning.stage = NAME
    _check_stage(config, 1)
    config.data.train_on_prompt = True
    check_scopes(config, 1)
    config.finetuning.pref_beta = 0.5
    with pytest.raises(ConfigError, match="finetuning.pref_beta=0.5 acts only with finetuning.stage dpo or kto"):
        check_scopes(config, 1)


@pytest.mark.parametrize("entry", ["no_such_stage_module", "/nonexistent/stage.py", "json.py"])
def test_a_module_that_does_not_import_is_named(monkeypatch, entry):
    """A missing module or file, or a file named as another imported module, is refused."""
    monkeypatch.setenv(PLUGINS_ENV, entry)
    with pytest.raises(ImportError, match=f"{PLUGINS_ENV}: stage module '{entry}' does not import"):
        get_stage("sft")


def test_a_file_path_imports_as_its_stem(plugin_dir, monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, str(plugin_dir / f"{MODULE}.py"))
    try:
        assert get_stage(NAME).megatron == f"{MODULE}:WeightedObjective"
        assert sys.modules[MODULE].__file__ == str(plugin_dir / f"{MODULE}.py")
    finally:
        unregister(NAME)
        sys.modules.pop(MODULE, None)


def _row(**changes: object) -> Stage:
    fields = dict(name="throwaway", reads=CONVERSATION, rows_per_example=1, reference_model=False,
                  extra_forwards=0, data_keys=CONVERSATION_DATA_KEYS, exact_match=False,
                  megatron="some.module:Objective", standard="some.module:Trainer")
    return Stage(**{**fields, **changes})


@pytest.mark.parametrize("changes, message", [
    ({"name": "sft"}, "name 'sft' is taken"),
    ({"name": "Weighted SFT"}, "is not a lower-case identifier"),
    ({"reads": "pairs"}, "reads 'pairs' is not one of text, conversation, preference_pair, feedback"),
    ({"megatron": "some/module.py"}, "megatron 'some/module.py' is not a dotted 'module:Class' path"),
    ({"standard": "some.module"}, "standard 'some.module' is not a dotted 'module:Class' path"),
    ({"rows_per_example": 0}, "rows_per_example and micro_step_examples must be >= 1"),
    ({"data_keys": ("template",)}, "data_keys ('template',) is not one of"),
    ({"loss_settings": ("pref_gamma",)}, "loss_settings ['pref_gamma'] are not among"),
])
def test_register_refuses_a_bad_row(changes, message):
    with pytest.raises(ValueError, match="stage row") as err:
        register(_row(**changes))
    assert message in str(err.value)
    assert "throwaway" not in STAGE_NAMES


def _expected(config, model_dir) -> list[tuple[float, float, float]]:
    """(weighted loss, weight sum, plain loss) of each step, computed by transformers' model on
    the micro-batches the run's loader gives the step, Adam (the run's settings) between."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_mca.config.loading import load_config
    from hpc_mca.data.dataset import build_datasets, train_dataloader

    # The rows are sft's (the same reads): this process does not import the plugin.
    resolved = load_config(config, ["stage=sft"]).resolve(world_size=1)
    run = resolved.data_run()
    loader = iter(train_dataloader(build_datasets(resolved.data, run).train, run, data_parallel_rank=0))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    expected = []
    for _ in range(STEPS):
        weighted = total = plain = tokens = 0.0
        for batch in itertools.islice(loader, resolved.training.gradient_accumulation_steps):
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
            labels = batch.labels.flatten()
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels, ignore_index=-100,
                                                       reduction="none")
            kept = labels != -100
            weights = torch.where(labels % 2 == 1, WEIGHT, 1.0) * kept
            weighted = weighted + (losses * weights).sum()
            total += float(weights.sum())
            plain += float(losses[kept].detach().sum())
            tokens += float(kept.sum())
        optimizer.zero_grad()
        (weighted / total).backward()
        optimizer.step()
        expected.append((float(weighted.detach()) / total, total, plain / tokens))
    return expected


@pytest.mark.parametrize("backend", ["megatron", "standard"])
def test_a_plugin_stage_trains_its_own_loss(tmp_path, plugin_dir, backend):
    model_dir = make_model_dir(tmp_path, layers=2)
    config = write_config(tmp_path, model_dir, make_sft_data(tmp_path, 32, 1, "train"),
                          finetuning={"stage": NAME},
                          training={"max_steps": STEPS, "logging_steps": 1, "save_steps": STEPS,
                                    "per_device_train_batch_size": 2, "global_batch_size": 4,
                                    "learning_rate": LR, "lr_scheduler_type": "constant",
                                    "warmup_steps": 0, "max_grad_norm": 0.0,
                                    "use_mca": backend == "megatron"})
    run_dir = tmp_path / "run"
    env = {**rank_env(), PLUGINS_ENV: str(plugin_dir / f"{MODULE}.py")}
    proc = run_ranks(1, ["train", str(config), f"training.output_dir={run_dir}"], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logged = steps(run_dir)
    assert [s["step"] for s in logged] == list(range(1, STEPS + 1))
    expected = _expected(config, model_dir)  # in this process, which has not imported the plugin
    assert MODULE not in sys.modules and NAME not in STAGE_NAMES
    for step, (loss, weight_sum, plain) in zip(logged, expected):
        assert abs(step["loss"] - loss) < TOLERANCE, (step, loss)
        assert step["tokens"] == weight_sum, (step, weight_sum)
        assert abs(loss - plain) > 100 * TOLERANCE, (loss, plain)  # sft's loss would not pass
