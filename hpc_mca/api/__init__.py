"""The Python API, as ROLL's mcore_adapter and transformers' scripts use it, over the same
trainer as ``hpc-mca train`` (which is a user of this package: :mod:`hpc_mca.launch.run`).

    from hpc_mca.models import AutoConfig, AutoModel
    from hpc_mca.trainer import DPOTrainer, McaTrainer
    from hpc_mca.training_args import Seq2SeqTrainingArguments

    args = Seq2SeqTrainingArguments(output_dir="runs/x", tensor_model_parallel_size=2, max_steps=100)
    model = AutoModel.from_pretrained("hf_model", args)
    trainer = McaTrainer(model=model, args=args, train_dataset=rows, data_collator=collator)
    trainer.train()
    trainer.save_model()

The same names are importable from here and from ``hpc_mca``. Modules: :mod:`.session` (the
checks before the process group, the process group), :mod:`.model` (``AutoConfig``,
``AutoModel``, ``McaModel``), :mod:`.data` and :mod:`.collated` (a script's datasets and
collator as training rows), :mod:`.trainer` (``McaTrainer``, ``DPOTrainer``); the arguments
are :mod:`hpc_mca.training_args`'. Run a script on every rank with ``hpc-mca run script.py``
(srun, torchrun, ``hpc-mca submit script.py``): a bad input then ends every rank with exit 2
and one line.
"""

from hpc_mca.runtime.quiet import quiet_library_noise

quiet_library_noise()  # before megatron is imported, as hpc-mca train does
from hpc_mca.trainer.dpo_config import DPOConfig  # noqa: E402
from hpc_mca.training_args import Seq2SeqTrainingArguments, TrainingArguments  # noqa: E402

from .model import AutoConfig, AutoModel, McaModel  # noqa: E402
from .trainer import DPOTrainer, McaTrainer  # noqa: E402

__all__ = ["AutoConfig", "AutoModel", "DPOConfig", "DPOTrainer", "McaModel", "McaTrainer",
           "Seq2SeqTrainingArguments", "TrainingArguments"]
