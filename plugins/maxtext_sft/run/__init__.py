"""The run's inputs: what a user may ask (every Param declared once), and what one run derives
from it before anything is paid for: its RunSpec, names and paths, MaxText command lines, the
Compute Engine request bodies, the dataset snapshot, the real model's size.

Lowest room: imports nothing else of maxtext_sft, and no client library at import time.
"""
