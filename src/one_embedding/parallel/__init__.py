"""Ranks: communicators and the ID / embedding / gradient shuffles that run over them."""
from .comm import Communicator, LocalComm
from .shuffle import IdExchange, owner_rank, shuffle_grads, shuffle_ids, shuffle_rows
from .unique import segment_sum, unique_ids

__all__ = ["Communicator", "IdExchange", "LocalComm", "owner_rank", "segment_sum", "shuffle_grads",
           "shuffle_ids", "shuffle_rows", "unique_ids"]
