"""The embedded platform's real node layer: upstream kubelet, containerd and runc per node (issue 14).

Selected by the profile's ``nodes.runtime: kubelet``; ``layer.start`` brings
it up. See ``fabric.py`` (the nodes' network), ``node.py`` (one node's
namespaces, files, cgroups and teardown), ``images.py`` (the images the
nodes start from), ``registry.py`` (where they pull them from),
``slowpull.py`` (the registry's slow path) and ``relay.py`` (the API
server and the registries inside node namespaces).
"""
