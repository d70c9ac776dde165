"""The embedded platform's real node layer: upstream kubelet, containerd and runc per node (issue 14).

Selected by the profile's ``nodes.runtime: kubelet``; ``layer.start`` brings
it up. See ``fabric.py`` (the nodes' network), ``node.py`` (one node's
namespaces, files, cgroups and teardown), ``images.py`` (the images the
nodes start from) and ``apiproxy.py`` (the API server inside node namespaces).
"""
