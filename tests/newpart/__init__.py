"""A new layer part end to end (tests/test_part_config.py)."""
