"""MaxText supervised fine-tuning on a Cloud TPU VM, as Airflow tasks and DAGs.

The package is cut into rooms by concern, lowest first: `run` (the run's inputs), `results`,
`ui`, `cloud`, `vm`, `tasks`, `builders`. A module imports only from its own room and the rooms
below it (docs/modules.md; tests/plugins/test_module_layers.py).
"""
