"""From a config path to a trained model on every rank: the pre-process-group checks, then
the backend the config names (:func:`.run.run_training`). Above both backends, below the CLI.
"""
