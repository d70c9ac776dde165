"""Loads the rayproof pytest plugin for every test run from this checkout."""

pytest_plugins = ["fixtures.plugin"]
