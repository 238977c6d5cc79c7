"""Conversion: pure plans, planning, the torch and byte executors, the output folder; quantize / repack / shard / merge entry points."""
