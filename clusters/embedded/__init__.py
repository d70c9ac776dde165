"""Embedded Kubernetes control plane built from published Go modules (see build.py, NOTES.md)."""
