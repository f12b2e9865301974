"""Lockstep's test suite (docs/map.md, "Tests")."""
