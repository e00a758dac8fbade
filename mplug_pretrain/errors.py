"""Errors that name what is wrong: the dotted config field, the file, the sample."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    The message always starts with the dotted field name (e.g. ``optim.lr_vision``) or the path.
    """


class DataError(RuntimeError):
    """Input data cannot be used at all (no shards found, a manifest that lies, ...).

    Single corrupt samples are never raised: they are skipped and counted.
    """


class PeerRankError(RuntimeError):
    """Another rank froze or ended while this one waited for it; the message names the setting
    (``distributed.timeout_minutes``) or what the other rank was doing (``mplug: distributed error: ...``, exit 5)."""
