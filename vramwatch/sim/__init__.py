"""The simulated GPU: torch's allocator stats and NVML's readings with their real shapes.

It stands in for the hardware CI lacks, and can be driven: fill and fragment
memory, raise retries and OOMs, stall with power falling and utilisation
pinned, inject Xid events and NVML errors, lose the GPU. The node's state lives
in one JSON file (``sim-node.json`` in the spool directory) so ranks, the
server's fake NVML and the test or demo driving them all see the same card.
"""

from vramwatch.sim.allocator import SimAllocator, SimOutOfMemoryError
from vramwatch.sim.state import SimGpu, SimNode

__all__ = ["SimAllocator", "SimGpu", "SimNode", "SimOutOfMemoryError"]
