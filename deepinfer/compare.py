"""Compare two logit dumps against a measured noise floor.

A dump (`--dump-logits F` of `deepinfer reference` and `deepinfer-run`) holds,
per prompt, the token ids fed (prompt then generated) and one float32 logits
row per processed position: row j is the model's output after tokens[0..j].

`compare(a, b)` scores every position both dumps computed from the same
tokens: cosine similarity, relative error ||a - b|| / ||b|| (B is the
denominator: pass the reference as B) and argmax agreement. Once greedy
generation diverges the later rows saw different tokens, so they are not
compared.

The noise floor is how far the pure-torch reference drifts from itself when
only summation order (prompt chunk widths) and, for bf16, activation precision
change, teacher-forced on A's tokens so positions line up. `verdict` calls A
and B "within noise" when their worst relative error is at most MARGIN times
the floor's and their argmax agreement is at least the floor's (over the
same positions, when the floor was measured on A's tokens).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from deepinfer.errors import CompareError
from deepinfer.reader import CAP_MANIFEST, load_json

FLOOR_FORMAT = "deepinfer-noise-floor/1"
Note = Callable[[str], None]  # where a long measurement says what it is doing
MARGIN = 4.0  # default slack over the measured floor: another implementation rounds differently again
REL_MIN = 1e-6  # the floor's relative error never counts as less than this (a few fp32 ulps of a row)

# name -> (activation dtype, prompt chunk width); each is compared with fp32 in one chunk.
PERTURBATIONS = {
    "fp32 chunk 1": ("fp32", 1),  # token by token: decode-shaped matmuls, other summation order
    "fp32 chunk 3": ("fp32", 3),  # a width that splits prompts unevenly
    "bf16": ("bf16", None),  # bf16 activations, as released
}
FLOOR_DTYPES = {"fp32": ["fp32 chunk 1", "fp32 chunk 3"], "bf16": list(PERTURBATIONS)}


# --- dumps ---


@dataclass(frozen=True)
class Dump:
    path: Path
    tokens: list[list[int]]  # per prompt: prompt then generated ids
    logits: list[torch.Tensor]  # per prompt: [positions, V] float32, row j after tokens[0..j]
    meta: dict = field(default_factory=dict)  # what produced it: source, dtype, cache_quant, config_hash, checkpoint

    @property
    def vocab(self) -> int:
        return self.logits[0].shape[1]

    @property
    def dtype(self) -> str | None:
        return self.meta.get("dtype")

    @property
    def cache_quant(self) -> bool | None:
        value = self.meta.get("cache_quant")
        return None if value is None else value == "True"


def load_dump(path: str | Path) -> Dump:
    """Read a `--dump-logits` file: `tokens`/`logits` for prompt 0, `tokens.i`/`logits.i` for prompt i."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CompareError(f"{path}: no such file (expected a logit dump written by --dump-logits)")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise CompareError(f"{path}: not a safetensors logit dump ({e})") from None
    tokens: list[list[int]] = []
    logits: list[torch.Tensor] = []
    while True:
        suffix = "" if not tokens else f".{len(tokens)}"
        t, x = tensors.pop("tokens" + suffix, None), tensors.pop("logits" + suffix, None)
        if t is None and x is None:
            break
        where = f"{path}: prompt {len(tokens)}"
        if t is None or x is None:
            raise CompareError(
                f"{where}: has {'logits' if t is None else 'tokens'}{suffix} "
                f"but no {'tokens' if t is None else 'logits'}{suffix}"
            )
        if t.dim() != 1 or x.dim() != 2 or x.shape[0] > t.shape[0] or x.shape[0] == 0:
            raise CompareError(
                f"{where}: tokens{suffix} {list(t.shape)} and logits{suffix} {list(x.shape)} "
                "are not [N] ids and [positions <= N, vocab] rows"
            )
        tokens.append([int(i) for i in t])
        logits.append(x.float())
    if not tokens:
        raise CompareError(f"{path}: no `tokens`/`logits` tensors; not a logit dump from --dump-logits")
    if tensors:
        raise CompareError(
            f"{path}: unexpected tensors {sorted(tensors)} (prompts must be numbered 1, 2, ... without gaps)"
        )
    vocabs = {x.shape[1] for x in logits}
    if len(vocabs) > 1:
        raise CompareError(f"{path}: prompts have different vocabulary sizes {sorted(vocabs)}")
    return Dump(path, tokens, logits, meta)


def same_model(a: Dump, b: Dump) -> None:
    """Refuse dumps that record different models (their config hashes)."""
    ha, hb = a.meta.get("config_hash"), b.meta.get("config_hash")
    if ha and hb and ha != hb:
        raise CompareError(
            f"{a.path} comes from model {ha[:16]} but {b.path} from model {hb[:16]} "
            "(config hashes differ): not the same model"
        )


def floor_precision(a: Dump, b: Dump) -> tuple[str | None, bool | None]:
    """The floor's dtype and cache quantization for dumps of this precision: bf16 if either
    dump ran in bf16, fp32 if both say fp32; cache quantization if either quantized. None
    where the dumps do not say (dumps from before deepinfer recorded it)."""
    dtypes = {d.dtype for d in (a, b)}
    dtype = None if None in dtypes else "bf16" if "bf16" in dtypes else "fp32"
    quant = {d.cache_quant for d in (a, b)}
    return dtype, (None if quant == {None} else True in quant)


def recorded_checkpoint(a: Dump, b: Dump) -> Path | None:
    """The checkpoint a reference dump was made from, if either dump records one that exists here."""
    for d in (b, a):
        ckpt = d.meta.get("checkpoint")
        if ckpt and Path(ckpt).is_dir():
            return Path(ckpt)
    return None


# --- comparison ---


@dataclass(frozen=True)
class PromptComparison:
    index: int
    rows_a: int
    rows_b: int
    tokens_diverge_at: int | None  # first position where A and B fed different tokens (generation diverged)
    tokens: list[int]  # per compared position: the token fed there
    cosine: list[float]
    rel: list[float]
    argmax_a: list[int]
    argmax_b: list[int]

    @property
    def compared(self) -> int:
        return len(self.rel)

    @property
    def agree(self) -> int:
        return sum(x == y for x, y in zip(self.argmax_a, self.argmax_b))

    @property
    def worst_cosine(self) -> float:
        return float(torch.tensor(self.cosine, dtype=torch.float64).min())  # NaN propagates

    @property
    def worst_rel(self) -> float:
        return float(torch.tensor(self.rel, dtype=torch.float64).max())

    @property
    def first_divergent(self) -> int | None:
        """The first position whose argmax differs (None when all agree)."""
        return next((j for j, (x, y) in enumerate(zip(self.argmax_a, self.argmax_b)) if x != y), None)


@dataclass(frozen=True)
class Comparison:
    prompts: list[PromptComparison]

    @property
    def worst_cosine(self) -> float:
        return float(torch.tensor([p.worst_cosine for p in self.prompts], dtype=torch.float64).min())

    @property
    def worst_rel(self) -> float:
        return float(torch.tensor([p.worst_rel for p in self.prompts], dtype=torch.float64).max())

    @property
    def argmax_agreement(self) -> float:
        return sum(p.agree for p in self.prompts) / sum(p.compared for p in self.prompts)


def row_metrics(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine similarity and ||a - b|| / ||b|| per row of a, b [N, V], in float64. Equal rows
    have cosine exactly 1 (the computed ratio can land an ulp off, by summation order)."""
    a, b = a.double(), b.double()
    na, nb, diff = a.norm(dim=-1), b.norm(dim=-1), (a - b).norm(dim=-1)
    cosine = (a * b).sum(-1) / (na * nb)
    cosine = torch.where(diff == 0, 1.0, torch.nan_to_num(cosine, nan=0.0)).clamp(-1, 1)
    rel = torch.where(diff == 0, 0.0, diff / nb)
    return cosine, rel


def compare(a: Dump, b: Dump) -> Comparison:
    """Score every position A and B computed from the same tokens.

    Raises CompareError when the dumps cannot describe the same prompts:
    another prompt count, vocabulary, or tokens that differ where neither
    dump chose them greedily (so they differ in the prompt).
    """
    if len(a.tokens) != len(b.tokens):
        raise CompareError(
            f"{a.path} has {len(a.tokens)} prompts but {b.path} has {len(b.tokens)}; "
            "dump both from the same --prompt/--prompt-ids"
        )
    if a.vocab != b.vocab:
        raise CompareError(
            f"{a.path} has logits over {a.vocab} tokens but {b.path} over {b.vocab}; dump both from the same model"
        )
    prompts = []
    for i, (ta, tb, xa, xb) in enumerate(zip(a.tokens, b.tokens, a.logits, b.logits)):
        n = min(len(xa), len(xb))
        split = next((j for j in range(min(len(ta), len(tb))) if ta[j] != tb[j]), None)
        if split is not None:
            greedy = (
                0 < split <= n and ta[split] == int(xa[split - 1].argmax()) and tb[split] == int(xb[split - 1].argmax())
            )
            if not greedy:
                raise CompareError(
                    f"prompt {i}: {a.path} feeds token {ta[split]} at position {split} but "
                    f"{b.path} feeds {tb[split]}, and not as a greedy choice: the dumps come "
                    "from different prompts"
                )
            n = min(n, split)
        cosine, rel = row_metrics(xa[:n], xb[:n])
        prompts.append(
            PromptComparison(
                index=i,
                rows_a=len(xa),
                rows_b=len(xb),
                tokens_diverge_at=split,
                tokens=ta[:n],
                cosine=cosine.tolist(),
                rel=rel.tolist(),
                argmax_a=xa[:n].argmax(-1).tolist(),
                argmax_b=xb[:n].argmax(-1).tolist(),
            )
        )
    return Comparison(prompts)


# --- noise floor ---


@dataclass(frozen=True)
class Floor:
    """The worst drift of the reference from itself (fp32 in one chunk) over `perturbations`."""

    checkpoint: str
    dtype: str  # "fp32": summation order only; "bf16": also bf16 activations
    cache_quant: bool
    tokens: list[list[int]]  # the teacher-forced sequences it was measured on
    # per perturbation: name, worst cosine, worst rel, argmax agreement, and per prompt the
    # positions whose argmax flipped ("flips")
    perturbations: list[dict] = field(default_factory=list)
    format: str = FLOOR_FORMAT

    @property
    def cosine(self) -> float:
        return min(p["cosine"] for p in self.perturbations)

    @property
    def rel(self) -> float:
        return max(p["rel"] for p in self.perturbations)

    @property
    def argmax(self) -> float:
        return min(p["argmax"] for p in self.perturbations)

    def argmax_over(self, tokens: list[list[int]]) -> float:
        """The floor's argmax agreement over the positions fed `tokens`, when each is a prefix of its own.

        A comparison stops where greedy generation diverges; the flip rate of
        the floor over those same positions is the fair bar. Other tokens: the
        agreement over all of the floor's positions.
        """
        if len(tokens) != len(self.tokens) or any(t != f[: len(t)] for t, f in zip(tokens, self.tokens)):
            return self.argmax
        total = sum(len(t) for t in tokens)
        return min(
            1 - sum(sum(j < len(t) for j in f) for f, t in zip(p["flips"], tokens)) / total for p in self.perturbations
        )


def teacher_forced(model, tokens: list[list[int]], chunk: int | None) -> list[torch.Tensor]:
    """The model's logits [len(t), V] for each token sequence t, fed as a prompt in chunks of `chunk`."""
    from deepinfer.runtime.schedule import decode_model

    gens = decode_model(model, tokens, 1, chunk=chunk)
    return [torch.stack(g.logits) for g in gens]


def measure_floor(
    checkpoint: str | Path,
    tokens: list[list[int]],
    *,
    dtype: str = "bf16",
    cache_quant: bool = True,
    note: Note | None = None,
) -> Floor:
    """Run the reference on `tokens` (teacher-forced) as fp32 in one chunk and as each perturbation;
    `note(msg)` before each run (they take seconds to minutes).

    All runs break index top-k ties by lowest index (NeMo's rule depends on
    the chunk width, which would measure the rule, not rounding).
    """
    from deepinfer.regions.reference import ReferenceModel

    if dtype not in FLOOR_DTYPES:
        raise CompareError(f"floor dtype {dtype!r}: expected one of {sorted(FLOOR_DTYPES)}")
    models = {}

    def model(d: str):
        if d not in models:
            models[d] = ReferenceModel(checkpoint, dtype=d, cache_quant=cache_quant, ties="lowest")
        return models[d]

    vocab = model("fp32").config.text.vocab_size
    for i, t in enumerate(tokens):
        bad = sorted({x for x in t if not 0 <= x < vocab})
        if bad:
            raise CompareError(
                f"prompt {i}: token ids {bad[:5]} outside {checkpoint}'s vocabulary [0, {vocab}); "
                "measure the floor with the checkpoint the dump came from"
            )
    runs = len(FLOOR_DTYPES[dtype]) + 1
    say = note or (lambda msg: None)
    start = time.perf_counter()
    say(f"noise floor: run 1/{runs}, the fp32 reference in one chunk ({sum(map(len, tokens))} rows)")
    base = teacher_forced(model("fp32"), tokens, None)
    results = []
    for i, name in enumerate(FLOOR_DTYPES[dtype], 2):
        say(f"noise floor: run {i}/{runs}, {name} ({time.perf_counter() - start:.0f} s so far)")
        d, chunk = PERTURBATIONS[name]
        rows = teacher_forced(model(d), tokens, chunk)
        pairs = [row_metrics(x, y) for x, y in zip(rows, base)]
        flips = [torch.nonzero(x.argmax(-1) != y.argmax(-1)).flatten().tolist() for x, y in zip(rows, base)]
        results.append(
            {
                "name": name,
                "cosine": min(float(c.min()) for c, _ in pairs),
                "rel": max(float(r.max()) for _, r in pairs),
                "argmax": 1 - sum(map(len, flips)) / sum(len(x) for x in base),
                "flips": flips,
            }
        )
    return Floor(str(checkpoint), dtype, cache_quant, [list(t) for t in tokens], results)


def floor_tokens(dump: Dump) -> list[list[int]]:
    """The sequences a floor for `dump` is measured on: each prompt's fed tokens, one per logits row."""
    return [t[: len(x)] for t, x in zip(dump.tokens, dump.logits)]


def floor_for(
    dump: Dump, checkpoint: str | Path, *, dtype: str = "bf16", cache_quant: bool = True, note: Note | None = None
) -> Floor:
    """measure_floor on `dump`'s tokens, after checking the checkpoint's vocabulary is the dump's."""
    from deepinfer.regions.config import load_config

    vocab = load_config(checkpoint).text.vocab_size
    if vocab != dump.vocab:
        raise CompareError(
            f"{dump.path} has logits over {dump.vocab} tokens but {checkpoint} has a vocabulary "
            f"of {vocab}; measure the floor with the checkpoint the dump came from"
        )
    return measure_floor(checkpoint, floor_tokens(dump), dtype=dtype, cache_quant=cache_quant, note=note)


def save_floor(floor: Floor, path: str | Path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    d = asdict(floor)
    tmp.write_text(json.dumps({"format": d.pop("format"), **d}, indent=1) + "\n")
    os.replace(tmp, path)


def load_floor(path: str | Path) -> Floor:
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise CompareError(f"{path}: no such file (write one with `deepinfer noise-floor CKPT A -o FILE`)")
    d = load_json(
        path,
        CAP_MANIFEST,
        error=lambda msg: CompareError(f"{path}: not a noise-floor JSON file ({msg.removeprefix(f'{path}: ')})"),
    )
    if not isinstance(d, dict) or d.get("format") != FLOOR_FORMAT:
        got = d.get("format") if isinstance(d, dict) else None
        raise CompareError(
            f"{path}: format {got!r}, expected {FLOOR_FORMAT!r}; measure it again with `deepinfer noise-floor`"
        )
    try:
        floor = Floor(**d)
        for p in floor.perturbations:
            float(p["cosine"]), float(p["rel"]), float(p["argmax"]), str(p["name"])
            if len(p["flips"]) != len(floor.tokens):
                raise ValueError(f"{p['name']}: flips for {len(p['flips'])} prompts, tokens for {len(floor.tokens)}")
        if not floor.perturbations:
            raise ValueError("no perturbations")
    except (TypeError, KeyError, ValueError) as e:
        raise CompareError(f"{path}: malformed noise floor ({e})") from None
    return floor


# --- verdict ---


@dataclass(frozen=True)
class Verdict:
    within: bool
    rel_limit: float  # MARGIN * max(floor.rel, REL_MIN)
    argmax_limit: float  # the floor's argmax agreement over the positions compared
    margin: float

    @property
    def text(self) -> str:
        return "within noise" if self.within else "outside noise"


def verdict(c: Comparison, floor: Floor, margin: float = MARGIN) -> Verdict:
    rel_limit = margin * max(floor.rel, REL_MIN)
    argmax_limit = floor.argmax_over([p.tokens for p in c.prompts])
    within = c.worst_rel <= rel_limit and c.argmax_agreement >= argmax_limit  # NaN is outside
    return Verdict(within, rel_limit, argmax_limit, margin)


def floor_setting(dtype: str | None, cache_quant: bool | None, recorded) -> tuple[str, bool]:
    """The floor's precision: as given, else as the dumps record, else bf16 with cache quantization."""
    rec_dtype, rec_quant = recorded
    dtype = dtype or rec_dtype or "bf16"
    cache_quant = cache_quant if cache_quant is not None else rec_quant if rec_quant is not None else True
    return dtype, cache_quant


def judging_floor(
    a: Dump,
    b: Dump,
    *,
    checkpoint: Path | None,
    dtype: str | None,
    cache_quant: bool | None,
    note: Note,
) -> Floor:
    """The floor A and B are judged by, measured with `checkpoint`'s reference, else the checkpoint a
    reference dump records, at the dumps' precision (`floor_setting`); `note(msg)` says which."""
    checkpoint = checkpoint or recorded_checkpoint(a, b)
    if checkpoint is None:
        raise CompareError(
            f"no noise floor to judge {a.path} against {b.path}: give --noise-floor CKPT or --floor FILE "
            "(neither dump records a checkpoint found here), or --no-floor for the metrics alone"
        )
    dtype, cache_quant = floor_setting(dtype, cache_quant, floor_precision(a, b))
    note(f"measuring the noise floor with {checkpoint} ({dtype}, cache quant {'on' if cache_quant else 'off'})")
    return floor_for(a, checkpoint, dtype=dtype, cache_quant=cache_quant, note=note)


# --- reports ---


def fmt_pos(j: int | None) -> str:
    return "-" if j is None else str(j)


def table_lines(c: Comparison, *, per_step: bool = False) -> list[str]:
    """One row per prompt (or per position with per_step) and a summary line."""
    lines = []
    if per_step:
        lines.append(
            f"{'prompt':>6} {'pos':>5} {'token':>7} {'cosine':>12} {'rel err':>10} {'argmax A':>9} {'argmax B':>9}"
        )
        for p in c.prompts:
            for j in range(p.compared):
                mark = "" if p.argmax_a[j] == p.argmax_b[j] else "  <- differs"
                lines.append(
                    f"{p.index:>6} {j:>5} {p.tokens[j]:>7} {p.cosine[j]:>12.8f} {p.rel[j]:>10.3e} "
                    f"{p.argmax_a[j]:>9} {p.argmax_b[j]:>9}{mark}"
                )
        lines.append("")
    lines.append(
        f"{'prompt':>6} {'compared':>9} {'worst cosine':>13} {'worst rel':>10} {'argmax':>9} {'first divergent':>16}"
    )
    for p in c.prompts:
        note = "" if p.tokens_diverge_at is None else f"  (tokens diverge at {p.tokens_diverge_at})"
        lines.append(
            f"{p.index:>6} {f'{p.compared}/{p.rows_a}':>9} {p.worst_cosine:>13.8f} {p.worst_rel:>10.3e} "
            f"{f'{p.agree}/{p.compared}':>9} {fmt_pos(p.first_divergent):>16}{note}"
        )
    lines.append(
        f"summary: worst cosine {c.worst_cosine:.8f}, worst rel err {c.worst_rel:.3e}, "
        f"argmax agreement {c.argmax_agreement:.4f} over {sum(p.compared for p in c.prompts)} positions"
    )
    return lines


def floor_lines(floor: Floor) -> list[str]:
    lines = [
        f"noise floor ({floor.dtype}, cache quant {'on' if floor.cache_quant else 'off'}; "
        f"reference vs itself in fp32, one chunk):"
    ]
    for p in floor.perturbations:
        lines.append(f"  {p['name']:<14} cosine {p['cosine']:.8f}  rel err {p['rel']:.3e}  argmax {p['argmax']:.4f}")
    lines.append(f"  {'floor':<14} cosine {floor.cosine:.8f}  rel err {floor.rel:.3e}  argmax {floor.argmax:.4f}")
    return lines


def verdict_line(v: Verdict) -> str:
    return (
        f"verdict: {v.text} (limits: rel err <= {v.rel_limit:.3e} = {v.margin:g} x floor, "
        f"argmax agreement >= {v.argmax_limit:.4f})"
    )


def report_floor(floor: Floor) -> dict:
    return {
        "dtype": floor.dtype,
        "cache_quant": floor.cache_quant,
        "checkpoint": floor.checkpoint,
        "cosine": floor.cosine,
        "rel": floor.rel,
        "argmax": floor.argmax,
        "perturbations": floor.perturbations,
    }


def report_json(c: Comparison, floor: Floor | None, v: Verdict | None, *, per_step: bool = False) -> dict:
    prompts = []
    for p in c.prompts:
        d: dict[str, object] = {
            "index": p.index,
            "rows_a": p.rows_a,
            "rows_b": p.rows_b,
            "compared": p.compared,
            "tokens_diverge_at": p.tokens_diverge_at,
            "worst_cosine": p.worst_cosine,
            "worst_rel": p.worst_rel,
            "argmax_agree": p.agree,
            "first_divergent": p.first_divergent,
        }
        if per_step:
            d["steps"] = [
                {
                    "position": j,
                    "token": p.tokens[j],
                    "cosine": p.cosine[j],
                    "rel": p.rel[j],
                    "argmax_a": p.argmax_a[j],
                    "argmax_b": p.argmax_b[j],
                }
                for j in range(p.compared)
            ]
        prompts.append(d)
    out = {
        "prompts": prompts,
        "summary": {
            "worst_cosine": c.worst_cosine,
            "worst_rel": c.worst_rel,
            "argmax_agreement": c.argmax_agreement,
            "first_divergent": [p.first_divergent for p in c.prompts],
        },
        "floor": None,
        "verdict": None,
    }
    if floor is not None:
        out["floor"] = report_floor(floor)
    if v is not None:
        out["verdict"] = {
            "within": v.within,
            "text": v.text,
            "rel_limit": v.rel_limit,
            "argmax_limit": v.argmax_limit,
            "margin": v.margin,
        }
    return out


def judged_lines(c: Comparison, floor: Floor | None, v: Verdict | None, *, per_step: bool = False) -> list[str]:
    """The comparison's table, then the floor and the verdict (none without a floor)."""
    lines = table_lines(c, per_step=per_step)
    if floor is None or v is None:
        return lines + ["verdict: none (--no-floor)"]
    return lines + floor_lines(floor) + [verdict_line(v)]
