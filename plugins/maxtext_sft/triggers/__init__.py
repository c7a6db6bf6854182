"""Triggers the pipeline's deferrable operators wait on (run by Airflow's triggerer)."""
