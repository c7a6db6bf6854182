"""What people see in Airflow: the Fine-tunes page, the tasks' extra links, the run's note (a
listener), the owners' notifications, and the plugin classes that register them.

May import `run` and `results`: the API server and the scheduler load this room without the
cloud's client libraries.
"""
