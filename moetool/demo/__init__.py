"""The built-in tiny model and the demo chain."""
