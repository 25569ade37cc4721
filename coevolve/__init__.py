"""CoEvolve: agents and their training data, evolving together."""

__version__ = "0.1.0"
