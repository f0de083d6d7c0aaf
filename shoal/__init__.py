"""shoal: a fleet for serving language models from a message queue."""

__version__ = "0.1.0"
