"""Regenerate tests/golden/nemo_engram_map.json with NeMo AutoModel 0.7.0's own functions.

    python tests/golden/nemo_engram_map.py      # in a venv with nemo-automodel==0.7.0 (MODEL.md)

It loads tests/golden/synthetic_tokenizer/ as transformers' PreTrainedTokenizerFast and
records, from `deepseek_v41/engram.py`:
- `_compressed_token_map` of it: the map as a list and its key count;
- `DeepseekV41NgramHash` on a prompt of colliding tokens, with and without a masked
  position, for the tiny checkpoint's engram settings with `engram_pad_token_id` moved
  to a token whose compressed id differs from its own (the pad id goes through the map).
The tokenizer's sha256 is recorded; the test refuses a golden of another tokenizer.
Without NeMo it exits with a one-line message and leaves the golden alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE / "synthetic_tokenizer"
GOLDEN = HERE / "nemo_engram_map.json"
TEXT = "He said HE he, café cafe Café ﬁ fi Ａa 你\u00a0 😀\n\n  done"
# the tiny checkpoint's engram settings (regions/tiny.py), pad moved to "HE"
ENGRAM = {
    "engram_layer_ids": [1],
    "engram_num_embeddings": [4096],
    "engram_max_ngram_size": 3,
    "engram_vocab_size": 1000,
    "engram_n_heads": 2,
    "engram_pad_token_id": 267,
}
MASKED = 5  # the position the masked run blocks


def tokenizer_digest() -> str:
    return "sha256:" + hashlib.sha256((TOKENIZER / "tokenizer.json").read_bytes()).hexdigest()


def main() -> None:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    try:
        import torch
        from nemo_automodel.components.models.deepseek_v41 import engram
        from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        sys.exit(f"NeMo AutoModel 0.7.0 is not installed here ({e}); {GOLDEN.name} left unchanged")
    import nemo_automodel

    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER / "tokenizer.json"))
    token_map, count = engram._compressed_token_map(tok)
    config = DeepseekV41TextConfig(vocab_size=len(tok), engram_compressed_vocab_size=count, **ENGRAM)
    hasher = engram.DeepseekV41NgramHash(config, tok)
    ids = [0] + tok.backend_tokenizer.encode(TEXT, add_special_tokens=False).ids
    input_ids = torch.tensor([ids])
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    mask[0, MASKED] = False
    out = {
        "source": f"nemo-automodel {nemo_automodel.__version__}, deepseek_v41/engram.py: _compressed_token_map and "
        "DeepseekV41NgramHash, on tests/golden/synthetic_tokenizer (tests/golden/nemo_engram_map.py)",
        "tokenizer_sha256": tokenizer_digest(),
        "count": count,
        "map": list(token_map),
        "engram": {**ENGRAM, "engram_compressed_vocab_size": count},
        "text": TEXT,
        "ids": ids,
        "hashes": hasher(input_ids)[0].tolist(),  # [positions, layers, heads]
        "masked_position": MASKED,
        "masked_hashes": hasher(input_ids, token_mask=mask)[0].tolist(),
    }
    GOLDEN.write_text(json.dumps(out) + "\n")
    print(f"wrote {GOLDEN} ({len(token_map)} ids -> {count} keys)", file=sys.stderr)


if __name__ == "__main__":
    main()
