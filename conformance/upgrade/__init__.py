"""Clause UPG-1: the KubeRay operator upgraded under running workloads."""
