"""The embedded platform's real node layer: upstream kubelet, containerd and runc per node (issue 14).

The platform's only node runtime (the profile's ``nodes.runtime: kubelet``;
the project's node agent retired in issue 39); ``layer.start`` brings it
up. See ``fabric.py`` (the nodes' network), ``node.py`` (one node's
namespaces, files, cgroups and teardown), ``images.py`` (the images the
nodes start from), ``registry.py`` (where they pull them from),
``slowpull.py`` (the registry's slow path), ``relay.py`` (the API
server and the registries inside node namespaces) and ``provisioner.py``
(the StorageClasses' volumes).
"""
