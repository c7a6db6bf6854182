"""The run's VM: SSH to it (sync and async hooks, host keys pinned), which step script runs with
which quoted arguments, a step on every host of a slice, making a lost VM again and resuming its
training, and the triggers that watch it over SSH (login ready, training status).

May import every room below: `run`, `results`, `ui`, `cloud`.
"""
