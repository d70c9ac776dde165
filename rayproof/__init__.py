"""rayproof: chaos and conformance certification for Ray-on-Kubernetes platforms."""

__version__ = "0.1.0"
