"""The Python API: ``TrainingArguments``, ``AutoModel`` and ``McaTrainer``, as ROLL's and
transformers' scripts use them, over the same trainer as ``hpc-mca train`` (which is a user of
this package: :mod:`hpc_mca.launch.run`).

    from hpc_mca import AutoModel, McaTrainer, TrainingArguments

    args = TrainingArguments(output_dir="runs/x", model_name_or_path="hf_model", dataset="train.jsonl",
                             tensor_model_parallel_size=2, max_steps=100)
    model = AutoModel.from_pretrained(args.model_name_or_path, args)
    trainer = McaTrainer(model=model, args=args)
    trainer.train()
    trainer.save_model()

Modules: :mod:`.arguments` (the flat dataclass; no torch), :mod:`.session` (the checks
before the process group, the process group), :mod:`.model` (``AutoModel``, ``McaModel``),
:mod:`.data` (a script's datasets and collator as training rows), :mod:`.trainer`
(``McaTrainer``). Run a script on every rank with ``hpc-mca run script.py`` (srun, torchrun,
``hpc-mca submit script.py``): a bad input then ends every rank with exit 2 and one line.
"""

from hpc_mca.runtime.quiet import quiet_library_noise

quiet_library_noise()  # before megatron is imported, as hpc-mca train does
from .arguments import Seq2SeqTrainingArguments, TrainingArguments  # noqa: E402
from .model import AutoModel, McaModel  # noqa: E402
from .trainer import McaTrainer  # noqa: E402

__all__ = ["AutoModel", "McaModel", "McaTrainer", "Seq2SeqTrainingArguments", "TrainingArguments"]
