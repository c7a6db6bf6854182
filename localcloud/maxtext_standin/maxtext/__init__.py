"""A STAND-IN for MaxText 0.2.2, not MaxText.

This package belongs to the project's local cloud. It imitates the three
MaxText commands the SFT pipeline runs, quickly and with the standard library
only (no JAX, no model, no network):

    python3 -m maxtext.checkpoint_conversion.to_maxtext ...
    python3 -m maxtext.trainers.post_train.sft.train_sft ...
    python3 -m maxtext.checkpoint_conversion.to_huggingface ...

It keeps what the pipeline can observe: the command-line syntax and the keys
it accepts (unknown keys fail as in MaxText), the directory layouts, how
Orbax publishes a checkpoint step (a temporary directory renamed into place;
on gs://, through the JSON API at $STORAGE_EMULATOR_HOST, commit_success.txt last),
the log lines, resuming from the latest checkpoint, and exit codes. File
contents are small fakes. Tests can inject faults (a crash, a stall, running
out of data, a failed conversion, a lost host) and change the time per step;
the fault file format is described in `maxtext._standin`. On a multi-host TPU
slice, train_sft runs as one process per host that together behave like a
multi-controller JAX run (`maxtext._distributed`).
"""
