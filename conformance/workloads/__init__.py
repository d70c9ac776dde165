"""Runtime clauses (WL-*): the workloads' own recovery, fail-fast and isolation on a real multi-node Ray cluster.

These certify the Ray and torch runtime a platform ships (the image), before
any Kubernetes is involved: checkpoint recovery, fail-fast collective
timeouts, GCS fault tolerance under Serve traffic, and head memory pressure.
"""
