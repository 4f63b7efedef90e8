"""The dashboards' uids and the variables a link may set, apart from the SDK.

A leaf module beside the contract: the alert rules link to the dashboards (their ``dashboard_url``
annotation) and must render without grafana-foundation-sdk installed, and neither the rules nor the
dashboards import each other.
"""

from __future__ import annotations

TRAINING_MEMORY_UID = "vramwatch-training-memory"
GPU_HEALTH_UID = "vramwatch-gpu-health"
FLEET_UID = "vramwatch-fleet"

# (alert label, dashboard variable it sets in a link): the variables every dashboard has
LINK_VARIABLES = (("instance", "host"), ("uuid", "gpu"), ("job_id", "job_id"), ("rank", "rank"))
