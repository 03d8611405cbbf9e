"""torch's dynamic rendezvous handler, made to read the workers' store address every round.

torch 2.13's ``DynamicRendezvousHandler`` works out the address of the workers' TCPStore
(``MASTER_ADDR``/``MASTER_PORT``) once, at an agent's first rendezvous, and hands the same
address out in every later round. That holds only while rank 0 stays on one node. When the
rank-0 node dies, the new rank 0 starts a store of its own and publishes its address, but a
survivor at another rank keeps giving its workers the dead node's port, and they fail to
connect until the restart budget is spent (seen with three agents, ``--nnodes 2:3``, the
rank-0 node SIGKILLed; with two agents the lone survivor is rank 0 and never reads it).
Forgetting the cached address before each round makes every agent read the new one.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler


class FreshStoreAddressHandler(RendezvousHandler):
    """Delegates to torch's handler, forgetting its cached store address before each round."""

    def __init__(self, handler: DynamicRendezvousHandler) -> None:
        self._handler = handler

    def next_rendezvous(self) -> RendezvousInfo:
        # torch rebuilds the address (rank 0: a new store server; others: read it from
        # the round's store) exactly when this cache is empty.
        self._handler._bootstrap_store_info = None
        return self._handler.next_rendezvous()

    def get_backend(self) -> str:
        return self._handler.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self._handler.use_agent_store

    def is_closed(self) -> bool:
        return self._handler.is_closed()

    def set_closed(self) -> None:
        self._handler.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._handler.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._handler.get_run_id()

    def shutdown(self) -> bool:
        return self._handler.shutdown()
