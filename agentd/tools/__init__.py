"""Built-in tools used by the demo organism and the tests."""
