"""One package per API dialect the gateway speaks: its request parsing and its output."""
