"""The DuckDB results store (schema + migrations, writers, queries, export)."""
