"""The compile's content-addressed artifact cache, one module per job:

    keys.py            a key: named parts hashed unambiguously; which options a key sees; explaining two keys
    artifact_keys.py   the key of each artifact a compile caches: trace, executable, weights, host, bundle
    entry.py           an entry on disk (artifact, meta.json, signature.json) and reading the records of keys
    local.py           the local tier, and `Cache`, which reads through to the remote tier; `CacheUse`
    remote.py          the remote tier: an S3 (or S3-compatible) store shared between machines
    fetch_or_build.py  what the compile passes do with the cache for each file they make

`open_cache` opens one (docs/cache.md); `default_cache` opens the one a compile uses unless told otherwise.
"""

from deepinfer.compiler.cache.local import Cache, open_cache

__all__ = ["default_cache", "open_cache"]


def default_cache(
    config, *, directory=None, url=None, endpoint=None, log=lambda msg: None, sign=None, trust=None
) -> Cache:
    """The cache a compile of `config` (a compiler.config.CompileConfig) uses, for deepinfer-compile and
    `compile_bundle` alike: its directory by `directory` (--cache-dir), else $DEEPINFER_CACHE_DIR, else
    model.toml's [cache] dir, else ~/.cache/deepinfer (under $XDG_CACHE_HOME when set); its remote tier by
    `url` and `endpoint` (--cache-url, --cache-endpoint), else the environment, else [cache] url and
    endpoint. `sign` and `trust`: the keys its entries are signed with and checked against."""
    from deepinfer.compiler.cache.remote import open_store

    store = open_store(url, endpoint, config.cache.url, config.cache.endpoint, log)
    return open_cache(directory, config.cache.dir, log=log, sign=sign, trust=trust, remote=store)
