"""Plain helpers of the tests (no fixtures: those are in tests/conftest.py), imported as
``from helpers.MODULE import NAME`` (``tests`` is on pytest's ``pythonpath``)."""
