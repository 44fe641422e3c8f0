"""The test tree as one package: tests.python.<folder>.<module>, the names by which test
modules import scenario modules and spawned ranks import the scenarios they run (see
tests/python/conftest.py)."""
