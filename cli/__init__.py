"""The `hipc` command (main.py): the one layer that uses both the compiler and the runtime."""
