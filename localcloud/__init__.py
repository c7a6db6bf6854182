"""The local cloud: emulators and sandbox VMs that stand in for Google Cloud in tests.

Nothing in dags/ or plugins/ imports this package; they reach it only through
connection values (API endpoints, SSH keys), as they would reach Google Cloud.
"""
