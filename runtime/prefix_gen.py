"""Prefix caching in the scheduler: which token group a request's cached prefix is in, where its prompt
chunks end, and, at a step's end, its full blocks, of its prompt and of its generated tokens alike,
cached under the key chain of the tokens it fed, with its slot state after the step that filled the
last where a state is kept (regions/prefix.py).

Every layout caches: each token group's pool has its own cache (a divided pool's blocks by shard),
a request goes to the group holding its longest usable prefix (`best_hit`, `hit_takes`), and a
slot state is kept with every `every`-th block only (`regions.prefix.state_every`: a budget of
bytes per cached block), saved and restored on every rank by message (runtime/slot_store.py).

The scheduler (`runtime/schedule.py`, `Scheduler._commit`) calls `cache_fed` after each step of a
sequence that has keys (prefix caching on, and a request that neither keeps nor is handed every
position's logits: `Scheduler._match` gives those no hit, so they cache nothing either, prompt or
generated). Every full block a step completes is cached; a step that ends on the boundary of a
block that keeps a state keeps the slot state there with that block if it ended `clean`:

- a prompt chunk (chunks end at the last such boundary they reach, else at the last block
  boundary, `chunk_end`);
- a plain decode step: it feeds one token, the last generated, so the step that feeds position
  j * block_size - 1 ends on the boundary and its slot state is the state there;
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

import functools
from collections.abc import Sequence

import torch

from deepinfer.regions.prefix import SlotState, StatePolicy, block_keys, extend_keys, root_key
from deepinfer.regions.spans import ImageEmbeds
from deepinfer.regions.stepper import Allocator, Stepper


def use_prefix_cache(stepper: Stepper, allocs: Sequence[Allocator], policy: StatePolicy) -> None:
    """Cache every token group's blocks, the slot states `policy` keeps (regions/prefix.py), each
    group's dropped states forgotten by `stepper` (its ranks free their copies)."""
    for g, a in enumerate(allocs):
        a.use_prefix_cache(policy.every, functools.partial(stepper.forget_slot, g), policy.max_states)


def image_root(image: ImageEmbeds | None) -> bytes:
    """The key root of a prompt (regions/prefix.py): its image positions and rows, if any."""
    if image is None:
        return root_key()
    rows = image.embeds.detach().to("cpu", torch.float32).contiguous()
    return root_key((image.mask.to("cpu").numpy().tobytes(), rows.numpy().tobytes()))


def prompt_keys(prompt: Sequence[int], block_size: int, image: ImageEmbeds | None) -> list[bytes]:
    """The keys of a prompt's full blocks."""
    return block_keys(prompt, block_size, image_root(image))


def best_hit(allocs: Sequence[Allocator], keys: Sequence[bytes]) -> tuple[int | None, list[int], SlotState | None]:
    """The token group whose cache holds the longest usable prefix of `keys` (a boundary with a kept
    slot state), its blocks and that state -> (None, [], None) on a miss everywhere."""
    best: tuple[int | None, list[int], SlotState | None] = (None, [], None)
    for g, a in enumerate(allocs):
        shared, state = a.match(keys)
        if len(shared) > len(best[1]):
            best = (g, shared, state)
    return best


def hit_takes(alloc: Allocator, shared: Sequence[int], need: int) -> list[int]:
    """Per shard, the blocks a request starting from cached `shared` and needing `need` in all takes
    from what the pool has available: its own new blocks and the shared ones nobody holds now (once
    held they are not evictable); nothing when `need` is 0 (no reservation)."""
    if not need:
        return [0] * alloc.shards
    takes = alloc.shard_counts(need, start=len(shared))
    cache = alloc.cache
    assert cache is not None
    for j, b in enumerate(shared):
        takes[j % alloc.shards] += (j % alloc.shards, b) in cache.unheld[j % alloc.shards]
    return takes


def chunk_end(consumed: int, n: int, alloc: Allocator) -> int:
    """A prompt chunk of up to `n` tokens from position `consumed`, cut to end where its slot state
    can be kept: at the last boundary of a block that keeps one (every `every`-th) it reaches, else
    at the last block boundary it reaches (so its blocks are cached as it ends), else as it is."""
    assert alloc.cache is not None
    for size in (alloc.block_size * alloc.cache.every, alloc.block_size):
        edge = (consumed + n) // size * size
        if edge > consumed:
            return edge - consumed
    return n


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
    image: ImageEmbeds | None,
) -> None:
    """After a step that fed sequence `seq` up to position `end` (the first `end` of `tokens`, its
    committed ones, then of `accepted`, a verify step's accepted drafts, which the step emits after
    this): extend `keys` (the chain so far; an empty one starts at the root of the prompt's `image`)
    over its full blocks and cache those it completed; a `clean` step that ends on the boundary of a
    block that keeps a slot state (every `every`-th of the cache) also keeps it there (unless the
    cache keeps one for that key already). The fed tokens are put together only when a block is
    completed, not every step."""
    n, edge = end // alloc.block_size, end % alloc.block_size == 0
    if n == 0:
        return
    if len(keys) < n:  # blocks of generated tokens this step completed
        fed = [*tokens, *accepted][:end]
        extend_keys(keys, fed, alloc.block_size, image_root(image) if not keys else b"")
    elif not edge:  # nothing new (a prompt's keys are all known: its chunks end on the boundaries they reach)
        return
    cache = alloc.cache
    assert cache is not None
    keep = clean and edge and cache.keeps_state(n)
    if not keep or cache.block_of.get(keys[n - 1]) in cache.states:
        alloc.cache_blocks(seq, keys[:n], None)
    else:
        alloc.cache_blocks(seq, keys[:n], stepper.save_slot(group, alloc.slot_of[seq]))
