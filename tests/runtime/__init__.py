"""The runtime tier (WL-*): the workloads' own recovery, fail-fast and memory behaviour on a real multi-node Ray cluster.

The suite's own validation, run by ``bin/rayproof test`` and never by
``certify``: it checks, on this machine and before any Kubernetes is
involved, that the workloads the clauses submit and the pinned Ray and torch
behave as the clauses assume (checkpoint recovery, fail-fast collective
timeouts, GCS fault tolerance under Serve traffic, head memory pressure).
It measures this host, not a certified platform, so none of it appears in a
certificate.
"""
