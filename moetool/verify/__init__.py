"""The distributed verify runtime: the driver (shards and reference in, a report out), the
rank launcher, router, reference forward, dispatchers, experts backends and the per-layer
forward. Import the modules themselves: this package imports nothing, so the parent process
of a verify run never loads Triton (its ranks do)."""
