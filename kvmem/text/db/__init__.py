"""The plaintext store's databases: connections and transactions (connections.py), what differs between SQLite
and PostgreSQL (dialect.py, pg.py), their schemas and migrations, the row statements that map a Memory onto
the tables, and a throwaway PostgreSQL server for tests and benchmarks."""
