"""Clauses OPS-1 and SEC-1: teardown after jobs, and what is exposed outside the cluster."""
