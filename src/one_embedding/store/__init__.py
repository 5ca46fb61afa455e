"""Stores: the bottom tiers that hold every key (host memory, the slot-file and RocksDB SSD
engines), their snapshots, durable file writes and the path LOCK."""
from .memory import MemoryStore
from .rocksdb_store import RocksDBStore
from .slot_file import SlotFileStore

__all__ = ["MemoryStore", "RocksDBStore", "SlotFileStore"]
