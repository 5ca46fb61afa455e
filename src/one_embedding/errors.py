"""The exception hierarchy. Every message names the offending value and says what to do instead."""


class OneEmbeddingError(Exception):
    """Base of every error this library raises on purpose."""


class ConfigError(OneEmbeddingError, ValueError):
    """An option, table declaration or store configuration that cannot work."""


class InputError(OneEmbeddingError, ValueError):
    """Ids, table ids, gradients or dense inputs of the wrong dtype, shape or value."""


class ClosedError(OneEmbeddingError, ValueError):
    """An object was used after its ``close()`` (a ValueError, as for a closed Python file)."""


class StoreError(OneEmbeddingError, RuntimeError):
    """A tier could not read or write rows (I/O failure, disk full, corrupt file)."""


class CapacityError(StoreError):
    """A tier cannot hold the rows it was asked to hold."""


class SnapshotError(StoreError):
    """A snapshot is missing, incomplete, or does not match the embedding that loads it."""


class LockedError(StoreError):
    """Another live process holds the persistent path."""


class ConventionWarning(UserWarning):
    """A setting left at its default whose result depends on a convention (OneFlow's formula or
    another common one): the message says which applies and how to choose."""
