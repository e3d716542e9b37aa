"""Importable targets for function-entrypoint tests (run inside worker processes)."""
