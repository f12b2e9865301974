"""KV storage and the prefix cache: `KVPool` hands out token slots, `RadixCache` shares them
between requests by token prefix, with the logprobs computed for them (`StoredLogprobs`). See
each module's docstring for the ownership contracts."""

from lockstep.cache.kv_pool import CacheIntegrityError, KVPool, KVPoolExhausted
from lockstep.cache.radix import InsertResult, Node, PrefixMatch, RadixCache
from lockstep.cache.stored_logprobs import StoredLogprobs

__all__ = [
    "CacheIntegrityError",
    "InsertResult",
    "KVPool",
    "KVPoolExhausted",
    "Node",
    "PrefixMatch",
    "RadixCache",
    "StoredLogprobs",
]
