"""The embedded platform's node agent: kubelet and container runtime for N local nodes.

Public API:

* :class:`NodeAgent` -- ``NodeAgent(kubeconfig, profile, state_dir, podnet, nodes=N, pki=...).start()``
  registers the nodes and runs their pods; ``stop()`` removes everything it made.
* :func:`cleanup` -- remove what an agent recorded under a state directory (after a crash).
* ``python -m clusters.embedded.nodeagent [run|down] ...`` -- the same as a process.

See README.md in this folder for what is and is not kubelet behaviour here.
"""
from __future__ import annotations

from clusters.embedded.nodeagent.agent import AgentError, Node, NodeAgent
from clusters.embedded.nodeagent.catalog import Image, ImageNotFound
from clusters.embedded.nodeagent.catalog import lookup as lookup_image
from clusters.embedded.nodeagent.state import cleanup

__all__ = ["AgentError", "Image", "ImageNotFound", "Node", "NodeAgent", "cleanup", "lookup_image"]
