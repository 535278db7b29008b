"""Batch jobs (run with `python -m cluster.jobs.<name>`, locally or through `ray job submit`)."""
