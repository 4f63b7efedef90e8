"""Everything that runs inside a training process: the sampler, the heartbeat, the allocator
reads, the in-process plugins (OOM forensics, hygiene, status line) and spawning the node server.
Nothing here imports ``vramwatch.server``: the two sides meet only in ``vramwatch.spool``.
"""
