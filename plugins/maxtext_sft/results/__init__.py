"""What a finished run leaves and how it is told: the loss curve and metrics, the export's record
and model card, the Asset, the run summary, the rehearsal's checks, a run in a user's words.

Pure functions over a run's values: may import `run` only.
"""
