"""Cluster back-ends for rayproof."""
