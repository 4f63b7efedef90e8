"""The node's scrape server, a process of its own: HTTP, the collectors (NVML, Xid, processes,
the ranks' samples) and the registry. It never imports torch nor ``vramwatch.rank``: what it knows
of the ranks comes through ``vramwatch.spool``.
"""
