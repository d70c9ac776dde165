"""Clauses TRN-1..2: training recovery from checkpoints when pods die."""
