"""Helpers the tests of several files share, one module per topic (the test files of a topic are
tests/*/test_TOPIC*.py). Nothing here is collected as a test."""
