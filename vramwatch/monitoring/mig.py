"""PromQL for MIG: from a series of a MIG instance to its card, and memory against the right total.

A rank on a MIG instance labels its series with the instance's ``MIG-`` uuid, which its instance's
``gpu_mig_memory_*`` series carry too (a plain ``on(uuid)`` join); the card's ``gpu_*`` series carry the
card's ``GPU-`` uuid, which ``gpu_mig_info`` maps the instance to (``parent_uuid``). docs/MIG.md shows both.
"""

from __future__ import annotations

from vramwatch.monitoring import contract

ON = "on(job, instance, uuid)"  # a GPU (or MIG instance) of one target, as the dashboards and alerts join


def to_parent(expr: str, info_selector: str = "") -> str:
    """``expr`` with each MIG instance's ``uuid`` replaced by its card's (its other series unchanged), so that
    ``to_parent(e) * on(job, instance, uuid) group_left(name) gpu_info`` reaches the card of every series."""
    contract.spec("gpu_mig_info")
    info = f"gpu_mig_info{info_selector}"
    return (  # in parentheses: `or` binds last, and the caller multiplies the whole
        f'(label_replace({expr} * {ON} group_left(parent_uuid) {info}, "uuid", "$1", "parent_uuid", "(.+)")'
        f" or ({expr} unless {ON} {info}))"
    )


def memory_ratio(used: str, total: str, mig_used: str, mig_total: str) -> str:
    """Used / total of every card not in MIG mode and of every MIG instance (its own total, not the card's).

    A card in MIG mode keeps its own series (the whole card) too; a job on an instance matches only the
    instance's, by uuid."""
    return f"({used} / {total} or {mig_used} / {mig_total})"
