"""The coordinator: one async Ray actor per root group, and the client ranks use to reach it.

The coordinator is the control plane. It does rendezvous (world size, rank uniqueness, each
rank's node), keeps a small key-value store, matches every collective's arrivals (sequence
number, step, fingerprint), routes small payloads and object references between ranks,
reduces small payloads inline, matches point-to-point messages, and reports failures to
every rank involved: mismatched arguments, a rank that rejected its own arguments, ranks that
never arrived (by name, with their last completed collective), an aborted group. Subgroups
made with ``new_group`` share their root group's coordinator, keyed by group name.

It knows nothing of arrays beyond metadata and small inline payloads: large data travels as
object references that it only forwards.

The package, by concern:

- :mod:`.logic`: the pure part (result encoding, fingerprint and metadata matching, error
  texts, Join answers), no Ray; what other modules import when they need only a helper.
- :mod:`.state`: the actor's tables; :mod:`.actor`: the actor (membership, key-value store,
  status) and how it is started, combining :mod:`.steps` (step matching), :mod:`.transports`
  (round-transport bookkeeping), :mod:`.join_state`, :mod:`.mailbox` (point to point) and
  :mod:`.liveness` (leases, probes, rank death).
- :mod:`.client`: :class:`CoordinatorClient`, one typed method per RPC, every wait bounded.
- :mod:`.spare`: the coordinator a driver keeps started ahead for its next group, and the
  group names of the job; :mod:`.hosting`: the coordinators of one ``create_groups`` call's
  groups, hosted in one process.
"""

from raycoll.coordinator.actor import Coordinator, start_coordinator
from raycoll.coordinator.client import GRACE_S, CoordinatorClient, rank_info
from raycoll.coordinator.logic import (JOIN_OUT_OF_STEP, coordinator_name, fingerprint_mismatch,
                                       join_outcome, meta_mismatch, unwrap)

__all__ = ["Coordinator", "CoordinatorClient", "coordinator_name", "GRACE_S",
           "fingerprint_mismatch", "meta_mismatch", "unwrap", "start_coordinator", "rank_info",
           "JOIN_OUT_OF_STEP", "join_outcome"]
