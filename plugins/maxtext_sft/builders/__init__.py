"""The DAG builders: the runbook's task graph shared by every DAG that fine-tunes, the bake's
graph, declared jobs' files made into DAGs, and the settings they share (connection ids,
defaults). The files in dags/ are thin calls into this room.

Top room: may import every other.
"""
