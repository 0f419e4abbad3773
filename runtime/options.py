"""How a bundle is run: typed, frozen options for `runtime.generate` and `runtime.serve`.

`LoadOptions` are what opening and loading a bundle take (both commands share them, and rank
processes receive them); `RunOptions` add what one batch generation asks for, `ServeOptions`
what the HTTP server does; both take `max_step_tokens`, the scheduler's token budget per step
(runtime/budget.py), refused at construction when under 1 (`BudgetError`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from deepinfer.regions.spans import ImageEmbeds
from deepinfer.runtime.budget import check_budget

COLLECTIVE_TIMEOUT_S = 600.0  # a collective (a step's broadcast included) that waits longer fails
CHUNK_BYTES = 64 << 20  # float32 collectives run in chunks of at most this many bytes per rank
SPECULATIVE = ("dspark",)  # drafts a bundle can compile in ([speculative] draft)


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a bundle is opened and loaded, on every rank."""

    num_kv_blocks: int | None = None  # the KV block pool (None: the bundle's num_blocks)
    verify: bool = True  # check every file's digest at open
    trust: Path | None = None  # an Ed25519 public key (PEM) the bundle must be signed by
    threads: int | None = None  # host threads for the executables (None: torch's default)
    speculative: str | None = None  # "dspark": decode greedy requests with the bundle's compiled draft
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    chunk_bytes: int = CHUNK_BYTES

    def load_options(self) -> LoadOptions:
        """Just these options (what a rank process receives, whatever subclass holds them)."""
        return LoadOptions(**{f.name: getattr(self, f.name) for f in fields(LoadOptions)})


@dataclass(frozen=True, kw_only=True)
class RunOptions(LoadOptions):
    """One batch generation: every prompt to completion (greedy)."""

    max_new_tokens: int = 16
    images: tuple[ImageEmbeds | None, ...] | None = None  # per prompt: its image positions and rows
    keep_logits: bool = False  # each completion's logits, one [V] row per position (--dump-logits)
    timeout_s: float = 3600.0  # the whole run, when this process starts the ranks
    max_step_tokens: int | None = None  # tokens a step feeds at most (runtime/budget.py; None: no budget)

    def __post_init__(self) -> None:
        check_budget(self.max_step_tokens)


@dataclass(frozen=True, kw_only=True)
class ServeOptions(LoadOptions):
    """The OpenAI HTTP server (`deepinfer-serve`)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port (the URL given to `on_ready` names it)
    max_queue: int = 64  # requests that may wait beyond the batch's free rows (more: HTTP 429)
    model_name: str | None = None  # the model's id in the API (None: the bundle directory's name)
    on_loading: Callable[[str], None] | None = None  # called with a line naming what loads, once the address is bound
    on_ready: Callable[[str], None] | None = None  # called with a line naming the URL once it serves
    prefix_cache: bool = True  # share full blocks (prompt, generated) between requests (regions/prefix.py)
    prefix_state_mib: float = 1.0  # slot state kept per cached block, amortized: one kept every k blocks
    prefix_states_mib: float = 1024.0  # the kept slot states' bytes on a rank at most (the least recent dropped)
    max_step_tokens: int | None = None  # tokens a step feeds at most (runtime/budget.py; None: no budget)
    # HTTP limits (runtime/serving/limits.py)
    max_body_bytes: int = 16 << 20  # a request body over it: 413
    max_connections: int = 256  # open connections; one more gets 503 and is closed
    header_timeout_s: float = 10.0  # a request's headers must arrive within it (else the connection is cut)
    body_timeout_s: float = 60.0  # a request's body must arrive within it (else 408)
    grace_s: float = 30.0  # at a stop signal, what open requests get to end before they are ended
    watchdog_s: float = 300.0  # an engine with work but no finished step for this long: /health 503 (0: off)

    def __post_init__(self) -> None:
        check_budget(self.max_step_tokens)
