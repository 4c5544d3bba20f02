"""The reports layer: the DuckDB ledger, report queries and the report CLI (imports pricing)."""
