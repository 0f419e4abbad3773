"""`model.toml`: the one place that parses it, into frozen dataclasses, one per section.

    [model]     checkpoint, dtype, cache_quant, tiny (generate when absent)
    [target]    name, executable, options
    [buckets]   batch, tokens, max_context, context, prompt_batch
    [kv]        block_size, num_blocks
    [parallel]  tp, ep, cp (bundles/topology.Topology itself: one spelling of the rank layout)
    [quant]     recipe
    [host]      embedding
    [cache]     dir, url (s3://bucket/prefix: the remote tier), endpoint (an S3-compatible server)
    [memory]    limit_gib, reserve_gib (device memory per rank: compiler/budget.py)
    [speculative] draft (compile the checkpoint's speculative draft into the bundle)
    [prompt]    rows ("replicated": every rank of a token group computes every row of a prompt chunk;
                "divided": each its share, regions/rows.py)

Unknown sections or keys, wrong types and impossible values raise ConfigError
naming the file, the key and its line, and listing what is valid.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.bundles.topology import Topology
from deepinfer.errors import ConfigError
from deepinfer.reader import CAP_SMALL, MAX_DEPTH, read_bytes
from deepinfer.schema import Problem, Rules, build

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True, kw_only=True)
class TinySection:
    """Generate the make-tiny checkpoint at `checkpoint` when it is absent."""

    seed: int = 0
    layers: int = 6


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    checkpoint: Path
    dtype: str = "fp32"
    cache_quant: bool = True
    tiny: TinySection | None = None


@dataclass(frozen=True, kw_only=True)
class TargetSection:
    name: str = "cpu"
    executable: str | None = None  # None: the target's first (cpu: aoti, trn2: neff)
    options: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class BucketSection:
    batch: tuple[int, ...] = (1,)
    tokens: tuple[int, ...] = (1,)
    max_context: int = 256
    # context buckets (positions, ascending, the last max_context): kinds whose shapes depend on the
    # context are built once per bucket; a step runs the smallest that holds its longest sequence.
    # None: [max_context]
    context: tuple[int, ...] | None = None
    # the batch buckets of a step with a prompt chunk (tokens > 1), a subset of `batch`; None: `batch`.
    # A long chunk is bound by compute at one sequence, and a divided chunk's gathered context grows
    # with the batch (compiler/budget.py): the scheduler then alternates prompt and decode steps
    prompt_batch: tuple[int, ...] | None = None

    def shapes(self) -> list[tuple[int, int]]:
        """Every (batch, tokens) step shape an executable is compiled for."""
        prompt = self.batch if self.prompt_batch is None else self.prompt_batch
        return [(b, t) for b in self.batch for t in self.tokens if t == 1 or b in prompt]

    @property
    def contexts(self) -> tuple[int, ...]:
        """The context buckets: `context`, or [max_context] where model.toml leaves it out."""
        return (self.max_context,) if self.context is None else self.context


@dataclass(frozen=True, kw_only=True)
class KVSection:
    block_size: int = 16
    num_blocks: int = 64


@dataclass(frozen=True, kw_only=True)
class QuantSection:
    recipe: str = "target"  # the target's own (cpu: release, trn2: e4m3); compiler/weights.RECIPES


@dataclass(frozen=True, kw_only=True)
class HostSection:
    embedding: bool | None = None  # the token embedding on the host; None: the target's choice


@dataclass(frozen=True, kw_only=True)
class CacheSection:
    dir: Path | None = None
    url: str | None = None  # the remote tier, s3://bucket/prefix (compiler/cache/remote.py)
    endpoint: str | None = None  # an S3-compatible server, e.g. http://minio.internal:9000; None: AWS


# Credentials are never read from model.toml (a file that is committed and shared): a [cache] key
# that looks like one is refused with where they belong instead of "unknown key".
CREDENTIAL_KEY = re.compile(r"access|secret|token|password|credential|session", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class MemorySection:
    limit_gib: float | None = None  # device memory per rank; None: the target's (trn2 HBM per core x LNC)
    reserve_gib: float = 0.0  # kept free for the runtime and collectives


@dataclass(frozen=True, kw_only=True)
class SpeculativeSection:
    # the checkpoint's draft compiled beside the target ("dspark": its mtp.* stages); None: no draft
    draft: str | None = None


@dataclass(frozen=True, kw_only=True)
class PromptSection:
    # how a token group's ranks share a prompt chunk's rows: "replicated" (each computes every row) or
    # "divided" (each its T / (tp * cp) rows, regions/rows.py: cp > 1, tp = 1, ep = cp, no draft, cpu)
    rows: str = "replicated"


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    source: Path
    model: ModelSection
    target: TargetSection
    buckets: BucketSection
    kv: KVSection
    parallel: Topology
    quant: QuantSection
    host: HostSection
    cache: CacheSection
    memory: MemorySection
    speculative: SpeculativeSection
    prompt: PromptSection


SECTIONS = {
    "model": ModelSection,
    "target": TargetSection,
    "buckets": BucketSection,
    "kv": KVSection,
    "parallel": Topology,
    "quant": QuantSection,
    "host": HostSection,
    "cache": CacheSection,
    "memory": MemorySection,
    "speculative": SpeculativeSection,
    "prompt": PromptSection,
}
DTYPES = ("fp32", "bf16")
QUANT_RECIPES = ("target", "release", "e4m3")  # "target" or a name of compiler/weights.RECIPES
DRAFTS = ("dspark",)
PROMPT_ROWS = ("replicated", "divided")


class _Where:
    """Locates `[section]` / `key =` lines in the TOML text for error messages."""

    def __init__(self, path: Path, text: str):
        self.path, self.lines = path, text.splitlines()

    def line(self, section: str, key: str | None = None) -> int | None:
        in_section = False
        for i, raw in enumerate(self.lines, 1):
            s = raw.split("#", 1)[0].strip()
            if s.startswith("["):
                in_section = s.strip("[] ").split(".")[0] == section
                if in_section and key is None:
                    return i
            elif in_section and key and re.match(rf"{re.escape(key)}\s*=", s):
                return i
        return None

    def error(self, section: str, key: str | None, message: str) -> ConfigError:
        line = self.line(section, key)
        name = f"{section}.{key}" if key else f"[{section}]"
        name = name.encode("unicode_escape").decode()  # one line, whatever the keys hold
        at = f":{line}" if line else ""
        return ConfigError(f"{self.path}{at}: {name}: {message}")


def _resolve(base: Path, value: str) -> Path:
    """A path of the file: relative to its folder, `~` expanded."""
    if "\0" in value:
        raise ValueError("a path cannot hold a NUL character")
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def _targets() -> dict:
    from deepinfer.compiler.targets import TARGETS

    return TARGETS


def _check(cfg: CompileConfig, where: _Where) -> None:
    """The first value of `cfg` that is out of range, as where.error; the sections in file order."""

    def need(cond, section, key, message):
        if not cond:
            raise where.error(section, key, message)

    _check_model_target(cfg, need)
    _check_buckets(cfg, need)
    _check_parallel(cfg, need)
    _check_cache(cfg, need)
    _check_memory(cfg, need)
    _check_checkpoint(cfg, need)


Need = Callable[[object, str, str, str | None], None]  # (condition, section, key, message)


def _check_model_target(cfg: CompileConfig, need: Need) -> None:
    TARGETS = _targets()
    m, t = cfg.model, cfg.target
    need(m.dtype in DTYPES, "model", "dtype", f"expected one of {', '.join(DTYPES)}, got {m.dtype!r}")
    need(t.name in TARGETS, "target", "name", f"unknown target {t.name!r}; valid: {', '.join(TARGETS)}")
    kinds = TARGETS[t.name].EXECUTABLES
    need(
        t.executable in kinds,
        "target",
        "executable",
        f"target {t.name!r} builds {', '.join(kinds)}, not {t.executable!r}",
    )
    bad_option = TARGETS[t.name].check_options(t.options)
    need(bad_option is None, "target", "options", bad_option)


def _check_buckets(cfg: CompileConfig, need: Need) -> None:
    b, kv = cfg.buckets, cfg.kv
    for key in ("batch", "tokens"):
        values = getattr(b, key)
        need(
            values and all(v > 0 for v in values) and len(set(values)) == len(values),
            "buckets",
            key,
            f"expected distinct positive integers, got {list(values)}",
        )
    need(1 in b.tokens, "buckets", "tokens", "must include 1 (decode steps run one token per sequence)")
    if b.prompt_batch is not None:
        need(
            bool(b.prompt_batch)
            and set(b.prompt_batch) <= set(b.batch)
            and len(set(b.prompt_batch)) == len(b.prompt_batch),
            "buckets",
            "prompt_batch",
            f"expected distinct values of [buckets] batch {list(b.batch)}, got {list(b.prompt_batch)}",
        )
        need(
            cfg.speculative.draft is None,
            "buckets",
            "prompt_batch",
            "a draft's verify steps run more than one token at every batch bucket: leave prompt_batch out",
        )
    need(
        b.max_context > 0 and b.max_context >= max(b.tokens),
        "buckets",
        "max_context",
        f"must be positive and at least the largest tokens bucket ({max(b.tokens)})",
    )
    need(kv.block_size > 0, "kv", "block_size", "must be positive")
    ctx = list(b.contexts)
    need(
        ctx
        and ctx == sorted(set(ctx))
        and ctx[-1] == b.max_context
        and all(c > 0 and c % kv.block_size == 0 for c in ctx[:-1]),
        "buckets",
        "context",
        f"expected ascending context lengths, each a multiple of [kv] block_size ({kv.block_size}), "
        f"the last equal to max_context ({b.max_context}); got {ctx}",
    )
    min_blocks = -(-b.max_context // kv.block_size) * max(b.batch) + 1
    need(
        kv.num_blocks >= min_blocks,
        "kv",
        "num_blocks",
        f"{kv.num_blocks} blocks cannot hold {max(b.batch)} sequences of max_context {b.max_context} "
        f"(need at least {min_blocks}, block 0 is scratch)",
    )


def _check_parallel(cfg: CompileConfig, need: Need) -> None:
    """The parallel sizes, the quant recipe and the draft."""
    p = cfg.parallel
    for key in ("tp", "ep", "cp"):
        need(getattr(p, key) >= 1, "parallel", key, "must be at least 1")
    need(
        cfg.quant.recipe in QUANT_RECIPES,
        "quant",
        "recipe",
        f"unknown recipe {cfg.quant.recipe!r}; valid: {', '.join(QUANT_RECIPES)}",
    )
    draft = cfg.speculative.draft
    need(
        draft is None or draft in DRAFTS, "speculative", "draft", f"unknown draft {draft!r}; valid: {', '.join(DRAFTS)}"
    )
    _check_prompt_rows(cfg, need)


def _check_prompt_rows(cfg: CompileConfig, need: Need) -> None:
    """[prompt] rows: divided where this build can divide them (regions/rows.py), and each prompt
    bucket a whole number of rows a rank."""
    rows, p = cfg.prompt.rows, cfg.parallel
    need(rows in PROMPT_ROWS, "prompt", "rows", f"expected one of {', '.join(PROMPT_ROWS)}, got {rows!r}")
    if rows != "divided":
        return
    need(
        p.cp > 1 and p.tp == 1 and p.ep == p.cp,
        "prompt",
        "rows",
        f"divided rows need [parallel] cp > 1, tp = 1 and ep = cp (the MoE dispatches each rank's rows over "
        f"the token group); got tp = {p.tp}, ep = {p.ep}, cp = {p.cp}",
    )
    need(cfg.speculative.draft is None, "prompt", "rows", "divided rows are not built with a draft yet")
    bad = [t for t in cfg.buckets.tokens if t > 1 and t % p.cp]
    need(
        not bad,
        "prompt",
        "rows",
        f"divided rows need each prompt bucket of [buckets] tokens to be a multiple of cp = {p.cp}; {bad} are not",
    )


def _check_cache(cfg: CompileConfig, need: Need) -> None:
    from deepinfer.compiler.cache.remote import check_endpoint, check_url

    url, endpoint = cfg.cache.url, cfg.cache.endpoint
    need(url is None or check_url(url) is None, "cache", "url", url and check_url(url))
    need(
        endpoint is None or check_endpoint(endpoint) is None, "cache", "endpoint", endpoint and check_endpoint(endpoint)
    )


def _check_memory(cfg: CompileConfig, need: Need) -> None:
    mem = cfg.memory
    need(mem.limit_gib is None or mem.limit_gib > 0, "memory", "limit_gib", f"must be positive, got {mem.limit_gib}")
    need(mem.reserve_gib >= 0, "memory", "reserve_gib", f"must be at least 0, got {mem.reserve_gib}")
    need(
        mem.limit_gib is None or mem.reserve_gib < mem.limit_gib,
        "memory",
        "reserve_gib",
        f"{mem.reserve_gib} GiB leaves nothing of limit_gib = {mem.limit_gib}",
    )


def _check_checkpoint(cfg: CompileConfig, need: Need) -> None:
    m = cfg.model
    need(
        not m.checkpoint.exists() or m.checkpoint.is_dir(),
        "model",
        "checkpoint",
        f"{m.checkpoint} is a file; give the checkpoint directory (config.json and *.safetensors)",
    )
    if m.tiny is not None:
        need(m.tiny.layers >= 6, "model", "tiny", "layers must be at least 6")
        need(m.tiny.seed >= 0, "model", "tiny", f"seed must be at least 0, got {m.tiny.seed}")


def config_error(cfg: CompileConfig, section: str, key: str, message: str) -> ConfigError:
    """A ConfigError located at `section.key` of the model.toml `cfg` came from."""
    try:
        text = read_toml_text(cfg.source)
    except ConfigError:
        text = ""
    return _Where(cfg.source, text).error(section, key, message)


def read_toml_text(path: Path) -> str:
    """The text of the model.toml at `path`: a regular file under `CAP_SMALL`, strict UTF-8."""
    data = read_bytes(path, CAP_SMALL, error=ConfigError)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None


def parse_toml(text: str, path: Path) -> dict:
    """TOML text -> its tables, or ConfigError naming the file (and the line, or the key): not TOML,
    nested deeper than `MAX_DEPTH`, an integer outside TOML's 64-bit range (which the spec says a
    reader must refuse rather than keep), a float that is not finite."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line = re.search(r"line (\d+)", str(e))
        raise ConfigError(f"{path}{':' + line.group(1) if line else ''}: not valid TOML ({e})") from None
    except (ValueError, RecursionError) as e:  # an integer of over 4300 digits; arrays nested ~300 deep
        what = "nested too deep" if isinstance(e, RecursionError) else "an integer too large"
        raise ConfigError(f"{path}: not valid TOML ({what})") from None
    stack: list[tuple[tuple, object]] = [((), data)]
    while stack:
        key, value = stack.pop()
        if len(key) > MAX_DEPTH:
            raise ConfigError(f"{path}: {_dotted(key)}: nested more than {MAX_DEPTH} deep")
        if isinstance(value, dict):
            stack.extend((key + (k,), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((key + (i,), v) for i, v in enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < 1 << 63:
            raise ConfigError(f"{path}: {_dotted(key)}: an integer outside the 64-bit range TOML allows")
    return data


def _dotted(key: tuple) -> str:
    return Problem(key, "").dotted().encode("unicode_escape").decode()


def load_compile_config(path: str | Path) -> CompileConfig:
    """Parse and validate a model.toml. Relative paths are relative to the file."""
    path = Path(path)
    text = read_toml_text(path)
    data = parse_toml(text, path)
    where = _Where(path, text)
    unknown = [s for s in data if s not in SECTIONS]
    if unknown:
        raise where.error(unknown[0], None, f"unknown section; valid sections: {', '.join(SECTIONS)}")
    if "model" not in data:
        raise ConfigError(f"{path}: missing required section [model]")
    cache = data.get("cache")
    for key in cache if isinstance(cache, dict) else ():
        if CREDENTIAL_KEY.search(key):
            raise where.error(
                "cache",
                key,
                "credentials are never read from model.toml; the store's come from the standard AWS chain "
                "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws/credentials, or an "
                "instance role): remove this key",
            )
    base = path.resolve().parent
    rules = Rules(paths=lambda value: _resolve(base, value))
    model = data["model"]
    if isinstance(model, dict) and model.get("tiny") is False:  # tiny = false: no generation
        data["model"] = {k: v for k, v in model.items() if k != "tiny"}
    sections = {}
    for name, cls in SECTIONS.items():
        value = data.get(name, {})
        if not isinstance(value, dict):
            raise where.error(name, None, "expected a table")
        try:
            sections[name] = build(cls, value, key=(name,), rules=rules)
        except Problem as p:
            raise where.error(str(p.key[0]), str(p.key[1]) if len(p.key) > 1 else None, p.message) from None
    b = sections["buckets"]
    if b.context is None:
        sections["buckets"] = dataclasses.replace(b, context=(b.max_context,))
    t = sections["target"]
    if t.executable is None and t.name in _targets():
        sections["target"] = dataclasses.replace(t, executable=_targets()[t.name].EXECUTABLES[0])
    cfg = CompileConfig(source=path, **sections)
    _check(cfg, where)
    return cfg
