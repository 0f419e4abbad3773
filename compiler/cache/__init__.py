"""The compile's content-addressed artifact cache, one module per job:

    keys.py            a key: named parts hashed unambiguously; which options a key sees; explaining two keys
    artifact_keys.py   the key of each artifact a compile caches: trace, executable, weights, host, bundle
    entry.py           an entry on disk (artifact, meta.json, signature.json) and reading the records of keys
    local.py           the local tier, and `Cache`, which reads through to the remote tier; `CacheUse`
    remote.py          the remote tier: an S3 (or S3-compatible) store shared between machines
    fetch_or_build.py  what the compile passes do with the cache for each file they make

`open_cache` opens one (docs/cache.md).
"""

from deepinfer.compiler.cache.local import open_cache

__all__ = ["open_cache"]
