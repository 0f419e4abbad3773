"""Prefix caching at a step's end: a sequence's full blocks, of its prompt and of its generated tokens
alike, cached under the key chain of the tokens it fed, with its slot state after the step that
filled the last (regions/prefix.py).

The scheduler (`runtime/schedule.py`, `Scheduler._commit`) calls `cache_fed` after each step of a
sequence that has keys (prefix caching on, and a request that neither keeps nor is handed every
position's logits: `Scheduler._match` gives those no hit, so they cache nothing either, prompt or
generated) and whose step ended `clean`:

- a prompt chunk (chunks that reach a block boundary end at it, `Scheduler._chunk_of`);
- a plain decode step: its one fed token is the last one generated, so the step after the one that
  wrote position k * block_size - 1 ends on a boundary and its slot state is the state there;
- a verify step whose drafts were all accepted (every position it wrote is committed).

A verify step that rejected a draft is not clean: its slot's rings also hold what the rejected drafts
wrote past the committed end, so no state is kept after it. The blocks it completed are cached at
the next clean step that ends on a boundary, the state kept with that step's last block. The last
generated token is never fed, so it is never in a cached block; a next turn's prompt that repeats
the answer feeds it itself.

A chat's next turn (prompt = the previous prompt, the answer, then more) thus matches the answer's
blocks through `Scheduler._match`, and its `cached_tokens` covers them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deepinfer.regions.prefix import extend_keys
from deepinfer.regions.stepper import Allocator, Stepper


def cache_fed(
    stepper: Stepper,
    alloc: Allocator,
    group: int,
    seq: int,
    keys: list[bytes],
    tokens: Sequence[int],
    end: int,
    root: Callable[[], bytes],
) -> None:
    """After a clean step that fed sequence `seq` its first `end` tokens `tokens[:end]` (prompt then
    generated): if they end on a block boundary, extend `keys` (the chain so far; `root()` starts an
    empty one) over them and cache every full block, keeping the slot state with the last unless the
    cache keeps one for that key already."""
    bs = alloc.block_size
    if end == 0 or end % bs:
        return
    if len(keys) < end // bs:
        extend_keys(keys, tokens[:end], bs, root() if not keys else b"")
    blocks = keys[: end // bs]
    cache = alloc.cache
    assert cache is not None
    if cache.block_of.get(blocks[-1]) in cache.states:
        alloc.cache_blocks(seq, blocks, None)
    else:
        alloc.cache_blocks(seq, blocks, stepper.save_slot(group, alloc.slot_of[seq]))
