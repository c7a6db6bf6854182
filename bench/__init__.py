"""The benchmark (`make bench`): not product code and not a test. See bench/run.py."""
