"""Prefix caching at cp = ep = 4 through deepinfer-serve (its three followers one process each): the
slot state saved and restored on every rank by message (runtime/slot_store.py), the paged blocks
cached per cp rank's shard. The reference is the one-rank bundle's greedy run without any cache.

Once plainly, once with `--speculative dspark` and a slot-state budget of just over half a slot's state,
so a state is kept with every second block only (`regions.prefix.state_every`): a long prompt (11
chunks of 8), the same prompt again, then a chat's next turn that repeats the prompt and its answer.
"""

from __future__ import annotations

import random

import pytest

from deepinfer.compiler.budget import slot_state_bytes
from deepinfer.regions.prefix import state_every
from deepinfer.regions.tokenizer import ByteTokenizer
from deepinfer.runtime import RunOptions, generate, open_bundle
from deepinfer.runtime.serving.server_process import ServerProcess

XDIST_GROUP = "ranks-prefix"
LAYOUT = (1, 4, 4)  # cp = ep = 4: one token group, its paged pool divided over four ranks; with the draft
BLOCK = 4  # the rank bundles' block size
ANSWER = 12
PROMPT = [random.Random(8).randrange(3, 250) for _ in range(86)]


def cached(prompt_len: int, fed: int, every: int) -> int:
    """Tokens a hit reuses: the last kept boundary among the `fed` positions' full blocks, short of
    the prompt's last token."""
    blocks = min(fed, prompt_len - 1) // BLOCK
    return blocks // every * every * BLOCK


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_prefix_cache_at_cp_ep_4_keeps_the_one_rank_tokens(rank_bundle, one_rank_loaded, speculative):
    bundle = rank_bundle(*LAYOUT)
    state = slot_state_bytes(open_bundle(bundle, verify=False).manifest.kv.pools)
    mib = state * 0.55 / (1 << 20)  # just over half a state a block: one kept every second block
    every = state_every(state, int(mib * (1 << 20))) if speculative else 1
    assert every == (2 if speculative else 1)

    def greedy(prompt: list[int], n: int) -> list[int]:
        (out,) = generate(one_rank_loaded, [prompt], RunOptions(max_new_tokens=n))
        assert out.finish_reason == "length", "the reference must run its full length"
        return out.generated

    answer = greedy(PROMPT, ANSWER)
    turn = PROMPT + answer + [7, 9, 11]
    asks = [(PROMPT, ANSWER), (PROMPT, ANSWER), (turn, 6)]
    flags = ("--speculative", "dspark", "--prefix-state-mib", f"{mib:.9f}") if speculative else ()
    server = ServerProcess(bundle, "--model-name", "tiny", "--threads", "1", *flags)
    try:
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0) for p, n in asks]
    finally:
        assert server.stop() == 0, server.proc.stderr.read()
    texts = [r.choices[0].text for r in got]
    assert texts == [ByteTokenizer().decode(greedy(p, n)) for p, n in asks]
    details = [r.usage.prompt_tokens_details if r.usage else None for r in got]
    hits = [(d.cached_tokens or 0) if d is not None else 0 for d in details]
    assert hits[0] == 0 and hits[1] == cached(len(PROMPT), len(PROMPT), every) > 64
    fed = len(PROMPT) + ANSWER - 1  # the answer's last token is never fed
    if not speculative:
        assert hits[2] == cached(len(turn), fed, every) > len(PROMPT)  # the answer's blocks too
    else:  # a verify step that rejected a draft keeps no state: at least the prompt's kept boundary
        assert cached(len(turn), len(PROMPT), every) <= hits[2] <= cached(len(turn), fed, every)
