"""Solutions to the chapters' exercises, one module per chapter; ``tests/`` runs each one."""
