"""Alert rules defined in Python, rendered to a Prometheus rule file and a PrometheusRule."""
