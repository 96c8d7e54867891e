"""Shared foundations every layer may import: the workspace layout, the content-addressed artifact
store and the DuckDB catalog schema. Nothing here imports Prefect, torch or a stage library."""
