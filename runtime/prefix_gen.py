"""Prefix caching at a step's end: a sequence's full blocks, of its prompt and of its generated tokens
alike, cached under the key chain of the tokens it fed, with its slot state after the step that
filled the last (regions/prefix.py).

The scheduler (`runtime/schedule.py`, `Scheduler._commit`) calls `cache_fed` after each step of a
sequence that has keys (prefix caching on, and a request that neither keeps nor is handed every
position's logits: `Scheduler._match` gives those no hit, so they cache nothing either, prompt or
generated). Every full block a step completes is cached; a step that ends on a block boundary
keeps the slot state there with the last block if it ended `clean`:

- a prompt chunk (chunks that reach a block boundary end at it, `Scheduler._chunk_of`);
- a plain decode step: it feeds one token, the last generated, so the step that feeds position
  k * block_size - 1 ends on the boundary and its slot state is the state there;
- a verify step whose drafts were all accepted (every position it wrote is committed).

A verify step that rejected a draft is not clean: its slot's rings also hold what the rejected drafts
wrote past the committed end, so no state is kept after it (its blocks are cached without one: a
hit reaches past them only to a later block with a state). This is the cautious rule: a clean
step's state can still hold rows that an earlier step's rejected drafts wrote past its end, which
a hit then runs on from exactly as the sequence itself does (`Scheduler` says why nothing needs
restoring). The fed tokens are the committed ones
and a verify step's accepted drafts (`Completion.tokens` gets those only after the step). The last
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
    accepted: Sequence[int],
    end: int,
    clean: bool,
    root: Callable[[], bytes],
) -> None:
    """After a step that fed sequence `seq` up to position `end` (the first `end` of `tokens`, its
    committed ones, then of `accepted`, a verify step's accepted drafts, which the step emits after
    this): extend `keys` (the chain so far; `root()` starts an empty one) over its full blocks and
    cache those it completed; a `clean` step that ends on a block boundary also keeps the slot state
    with the last block (unless the cache keeps one for that key already). The fed tokens are put
    together only when a block is completed, not every step."""
    n, edge = end // alloc.block_size, clean and end % alloc.block_size == 0
    if n == 0:
        return
    if len(keys) < n:  # blocks of generated tokens this step completed
        fed = [*tokens, *accepted][:end]
        extend_keys(keys, fed, alloc.block_size, root() if not keys else b"")
    elif not edge:  # nothing new (a prompt's keys are all known: its chunks end on the boundaries they reach)
        return
    cache = alloc.cache
    assert cache is not None
    if not edge or cache.block_of.get(keys[n - 1]) in cache.states:
        alloc.cache_blocks(seq, keys[:n], None)
    else:
        alloc.cache_blocks(seq, keys[:n], stepper.save_slot(group, alloc.slot_of[seq]))
