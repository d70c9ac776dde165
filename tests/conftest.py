"""The project's own tests use pytester to run small suites in isolation."""

pytest_plugins = ["pytester"]
