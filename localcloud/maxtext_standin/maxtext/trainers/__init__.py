"""Part of the MaxText stand-in; see maxtext/__init__.py."""
