"""What runs inside Ray: training, serving, load and head pressure.

Each module imports only Ray, torch and the standard library and runs as a
plain script, so it can be shipped to any cluster (a ConfigMap or an image)
and used unchanged as a RayJob entrypoint.
"""
