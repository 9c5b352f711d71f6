"""The `diloco` command line."""
