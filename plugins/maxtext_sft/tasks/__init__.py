"""What Airflow runs: the operators, the sensors and the functions the DAG builders make tasks of
(plan, preflight, summarize, the outcome, samples, the janitor).

May import every room below. Tasks never import one another: what two share lives a room down;
`tasks.base` (the base class of a run's tasks) is the one module the others may import.
"""
