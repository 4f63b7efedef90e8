"""The exporter: in-rank sampling, the rank-to-server spool, and the node's scrape server."""
