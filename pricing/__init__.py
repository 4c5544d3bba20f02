"""The pricing layer: canonical usage, price catalog and exact costs (pure: no I/O, no clock)."""
