"""The distributed verify runtime. Import the modules themselves: this package imports nothing.

Parent of a run (never loads Triton): ``driver`` (shards and reference in, a report out),
``report``, ``launch`` (rank processes), ``tokens`` (the test inputs), ``reference`` and
``router`` (the single-process reference, shared with the ranks).
Rank processes: ``rank`` (one rank's run), ``layer`` (route -> dispatch -> experts ->
combine), ``dispatchers``, ``transports``, ``wire``, ``peer_memory``, ``graphs``,
``topology``, ``chunk``, ``experts``."""
