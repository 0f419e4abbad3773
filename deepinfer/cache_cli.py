"""`deepinfer cache ...`: parse, open the cache (`compiler.cache.open_cache`) or its store, call, print.

Registered on the `deepinfer` group by `deepinfer/cli.py`; errors as there (one line, exit status 2).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import click

from deepinfer.cli_common import trust_option, trusted_key, user_errors

UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_amount(text: str, units: dict, what: str, example: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]?)[bB]?\s*", text)
    if not m or m.group(2).lower() not in units:
        raise click.BadParameter(f"{text!r}: expected a {what} like {example}")
    return float(m.group(1)) * units[m.group(2).lower()]


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def open_local(cache_dir: Path | None, **kwargs):
    """The cache at --cache-dir (else $DEEPINFER_CACHE_DIR, else the user cache dir)."""
    from deepinfer.compiler.cache import open_cache

    return open_cache(cache_dir, log=_log, **kwargs)


def open_existing(cache_dir: Path | None):
    """The cache `open_local` opens, refused (CacheError, one line naming where the directory came
    from) where it is not a directory: listing, verifying or pruning nothing would say "0 entries"
    about a mistyped path."""
    import os

    from deepinfer.compiler.cache.entry import CacheError
    from deepinfer.compiler.cache.local import ENV_DIR

    cache = open_local(cache_dir)
    if not cache.dir.is_dir():
        where = "--cache-dir" if cache_dir is not None else f"${ENV_DIR}" if os.environ.get(ENV_DIR) else "the default"
        what = "not a directory" if cache.dir.exists() else "no such directory"
        raise CacheError(f"{cache.dir} ({where}): {what}; give --cache-dir the directory your compiles use")
    return cache


cache_dir_option = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Cache directory (default: $DEEPINFER_CACHE_DIR, else ~/.cache/deepinfer).",
)


def store_options(required: bool):
    """--url and --endpoint: the remote tier (compiler/cache/remote.py) a `deepinfer cache` command works on."""

    def add(fn):
        fn = click.option(
            "--endpoint",
            metavar="URL",
            help="S3-compatible server of --url, e.g. http://minio:9000 (default: $AWS_ENDPOINT_URL, else AWS).",
        )(fn)
        return click.option(
            "--url",
            metavar="s3://BUCKET/PREFIX",
            envvar="DEEPINFER_CACHE_URL" if required else None,
            help="The cache's remote tier"
            + (" (default: $DEEPINFER_CACHE_URL)." if required else ": work on it instead of the local directory."),
        )(fn)

    return add


def open_store(url: str | None, endpoint: str | None):
    """The store at --url (None without one)."""
    from deepinfer.compiler.cache.remote import Store

    return None if url is None else Store.from_url(url, endpoint, log=_log)


@click.group("cache")
def cache_group():
    """Inspect and maintain the artifact cache deepinfer-compile reads and writes."""


@cache_group.command("ls")
@cache_dir_option
@store_options(required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry, one a line.")
@user_errors
def cache_ls(cache_dir, url, endpoint, as_json):
    """List the cache's entries: kind, key, what it builds, size, last use
    (with --url, the store's: kind, key, what it builds, artifact size, when published).

    \b
    Examples:
      deepinfer cache ls
      deepinfer cache ls --url s3://ci-cache/deepinfer --json
    """
    store = open_store(url, endpoint)
    if store is not None:
        _store_ls(store, as_json)
        return
    cache = open_existing(cache_dir)
    entries = cache.entries()
    total = 0
    for e in sorted(entries, key=lambda e: (e.kind, e.meta.get("identity", ""))):
        size = cache.size(e)
        total += size
        if as_json:
            row = {"kind": e.kind, "key": e.key, "identity": e.meta.get("identity"), "size": size}
            click.echo(json.dumps(row | {"last_used": e.last_used}))
        else:
            age = (time.time() - e.last_used) / 3600
            click.echo(
                f"{e.kind:<10} {e.key[:16]}  {e.meta.get('identity', '?'):<32} {size / 1e6:9.2f} MB  "
                f"used {age:.1f} h ago"
            )
    if not as_json:
        click.echo(f"{len(entries)} entries, {total / 1e6:.2f} MB in {cache.dir}")


def _store_ls(store, as_json: bool) -> None:
    from deepinfer.compiler.cache.local import KINDS

    listed = store.listing(KINDS)
    for e, ident, size in listed:
        if as_json:
            row = {"kind": e.kind, "key": e.key, "identity": ident, "size": size, "published": e.last_modified}
            click.echo(json.dumps(row))
        else:
            age = (time.time() - e.last_modified) / 3600
            click.echo(f"{e.kind:<10} {e.key[:16]}  {ident or '?':<32} {size / 1e6:9.2f} MB  published {age:.1f} h ago")
    if not as_json:
        click.echo(f"{len(listed)} entries, {sum(size for _, _, size in listed) / 1e6:.2f} MB in {store.url}")


@cache_group.command("prune")
@cache_dir_option
@store_options(required=False)
@click.option("--max-size", help="Keep at most this much, least recently used removed first (e.g. 2G, 500M).")
@click.option("--max-age", help="Remove entries not used for this long (e.g. 7d, 12h).")
@user_errors
def cache_prune(cache_dir, url, endpoint, max_size, max_age):
    """Remove entries unused for --max-age, then the least recently used beyond --max-size.

    With --url, prune the store instead: entries published more than --max-age ago (the
    store keeps no last use; --max-size is for the local directory only), then the
    objects no entry names any more.

    \b
    Examples:
      deepinfer cache prune --max-size 5G --max-age 14d
      deepinfer cache prune --url s3://ci-cache/deepinfer --max-age 30d
    """
    if max_size is None and max_age is None:
        raise click.UsageError("give --max-size and/or --max-age")
    if url and max_size:
        raise click.UsageError("--max-size is for the local directory; prune the store (--url) by --max-age")
    size = parse_amount(max_size, UNITS, "size", "2G or 500M") if max_size else None
    age = parse_amount(max_age, AGES, "duration", "7d or 12h") if max_age else None
    store = open_store(url, endpoint)
    if store is not None:
        from deepinfer.compiler.cache.local import KINDS

        assert age is not None
        gone = store.prune(KINDS, age, time.time())
        for e in gone:
            click.echo(f"removed {e.kind} {e.key[:16]} from {store.url}")
        click.echo(f"removed {len(gone)} entries; {len(list(store.entries(KINDS)))} left in {store.url}")
        return
    cache = open_existing(cache_dir)
    removed = cache.prune(max_size=size, max_age=age)
    for e in removed:
        click.echo(f"removed {e.kind} {e.key[:16]} {e.meta.get('identity', '?')}")
    click.echo(f"removed {len(removed)} entries; {len(cache.entries())} left in {cache.dir}")


@cache_group.command("verify")
@cache_dir_option
@store_options(required=False)
@user_errors
def cache_verify(cache_dir, url, endpoint):
    """Re-hash every entry; remove corrupt ones (exit status 1 if any were found).

    With --url, verify the store: every entry's object is downloaded and re-hashed; a corrupt
    entry's meta.json is deleted (and its object, where its bytes do not match its name).

    \b
    Examples:
      deepinfer cache verify
      deepinfer cache verify --url s3://ci-cache/deepinfer
    """
    store = open_store(url, endpoint)
    if store is not None:
        import tempfile

        from deepinfer.compiler.cache.local import KINDS

        with tempfile.TemporaryDirectory() as scratch:
            n, bad = store.verify(KINDS, Path(scratch))
        for e, why in bad:
            click.echo(f"corrupt {e.kind} {e.key[:16]}: {why} (removed from the store)")
        click.echo(f"{n - len(bad)} of {n} entries intact in {store.url}")
        sys.exit(1 if bad else 0)
    cache = open_existing(cache_dir)
    n = len(cache.entries())
    bad = cache.verify()
    for e, why in bad:
        click.echo(f"corrupt {e.kind} {e.key[:16]} {e.meta.get('identity', '?')}: {why} (removed)")
    click.echo(f"{n - len(bad)} of {n} entries intact in {cache.dir}")
    if bad:
        sys.exit(1)


@cache_group.command("explain")
@click.argument("key_a")
@click.argument("key_b")
@cache_dir_option
@store_options(required=False)
@user_errors
def cache_explain(key_a, key_b, cache_dir, url, endpoint):
    """Compare two cache keys part by part (keys, unique key prefixes, or meta.json paths);
    with --url, a key not in the local directory is looked up in the store.

    \b
    Examples:
      deepinfer cache explain 3f2a9c01 7be41d55
      deepinfer cache explain 3f2a9c01 7be41d55 --url s3://ci-cache/deepinfer
    """
    from deepinfer.compiler.cache.keys import explain

    cache = open_local(cache_dir)
    store = open_store(url, endpoint)
    click.echo("\n".join(explain(_meta(cache, store, key_a), _meta(cache, store, key_b))))


def _meta(cache, store, ref: str) -> dict:
    """The meta.json of `ref`: a meta.json path, else a key (or unique prefix) here, else in the store."""
    from deepinfer.compiler.cache.entry import CacheError, explainable
    from deepinfer.compiler.cache.local import KINDS
    from deepinfer.reader import load_json

    if Path(ref).is_file():
        return explainable(load_json(Path(ref), error=CacheError), ref)
    entry = cache.find(ref)
    if entry is not None:
        return explainable(entry.meta, ref)
    found = store.find(ref, KINDS) if store is not None else None
    if found is None:
        where = f"{cache.dir}" + (f" or {store.url}" if store is not None else "")
        raise CacheError(
            f"{ref}: no single entry with this key in {where} (give 8+ characters "
            "of a key from `deepinfer cache ls`, or a meta.json path)"
        )
    return explainable(found[1], ref)


def _copy_options(fn):
    fn = click.option(
        "--bundle",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="Only the entries this bundle was built from (its cache-keys.json).",
    )(fn)
    fn = store_options(required=True)(fn)
    return cache_dir_option(fn)


def _cache_with_store(cache_dir, url, endpoint, **kwargs):
    if url is None:
        raise click.UsageError("give --url s3://BUCKET/PREFIX (or set $DEEPINFER_CACHE_URL)")
    return open_local(cache_dir, remote=open_store(url, endpoint), **kwargs)


def _wanted(bundle: Path | None) -> set[tuple[str, str]] | None:
    from deepinfer.compiler.cache.entry import bundle_keys

    return bundle_keys(bundle) if bundle else None


@cache_group.command("push")
@_copy_options
@user_errors
def cache_push(cache_dir, url, endpoint, bundle):
    """Publish the local directory's intact entries (all, or a bundle's) to the store; entries
    the store already has are left as they are. A compile with --cache-url publishes what it
    builds itself: push is for entries built without it.

    \b
    Examples:
      deepinfer cache push --url s3://ci-cache/deepinfer
      deepinfer cache push --bundle build/tiny --url s3://ci-cache/deepinfer --endpoint http://minio:9000
    """
    cache = _cache_with_store(cache_dir, url, endpoint)
    published, skipped = cache.push(_wanted(bundle))
    click.echo(f"published {published} entries to {cache.remote_url}; {skipped} already there (or corrupt here)")


@cache_group.command("pull")
@_copy_options
@trust_option
@user_errors
def cache_pull(cache_dir, url, endpoint, bundle, trust):
    """Install the store's entries (all, or a bundle's) in the local directory, each checked as a
    compile checks it (its digest; its signature under --trust). Before going offline, or to
    warm a runner's disk once for many compiles.

    \b
    Examples:
      deepinfer cache pull --url s3://ci-cache/deepinfer
      deepinfer cache pull --bundle build/tiny --url s3://ci-cache/deepinfer --trust ci.pem.pub
    """
    cache = _cache_with_store(cache_dir, url, endpoint, trust=trusted_key(trust))
    wanted = _wanted(bundle)
    installed, skipped = cache.pull(wanted)
    click.echo(
        f"pulled {installed} entries from {cache.remote_url} into {cache.dir}; {skipped} already here or refused"
    )
    if wanted is not None and installed + skipped < len(wanted):
        click.echo(f"{len(wanted) - installed - skipped} of the bundle's {len(wanted)} entries are not in the store")
