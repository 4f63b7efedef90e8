"""What the product promises to its users, as data: the metric contract, the monitoring config,
and the alert rules and dashboards built from them.
"""
