"""bench/reliability.py's file surfaces: model.toml, checkpoint, bundle and cache files, each mutated
and handed to the CLI that reads it (run in this process through click's runner, under an alarm)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

CLI_TIMEOUT_S = 30  # past this a case is a hang (a FIFO opened for reading waits for a writer forever)


@dataclass
class Case:
    surface: str
    name: str
    clean: bool
    why: str  # "refused", "accepted", or what was unclean
    output: str = ""


SKIP = {"cases": 0, "seen": 0}  # a restarted worker skips the cases its predecessor ran


def run_cli(main, args: list[str], timeout_s: int = CLI_TIMEOUT_S):
    """Invoke a click command here, under SIGALRM: (exit code or None on a hang, exception, stderr);
    None for a case skipped (`SKIP`)."""
    from click.testing import CliRunner

    SKIP["seen"] += 1
    if SKIP["seen"] <= SKIP["cases"]:
        return None

    def hang(*_):
        raise TimeoutError(f"no answer in {timeout_s} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(timeout_s)
    try:
        r = CliRunner().invoke(main, args, catch_exceptions=True)
    except TimeoutError as e:  # raised outside the command's own frames
        return None, e, ""
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return r.exit_code, r.exception, r.stderr


def judge_cli(surface: str, name: str, got, answers: tuple[int, ...] = (0,)) -> Case:
    """Clean: an answer (rc 0, or another of `answers`: `deepinfer cache verify` exits 1 when it found
    and removed corrupt entries), or rc 2 with exactly one `error:` line; never a traceback."""
    if got is None:
        return Case(surface, name, True, "skipped")
    code, exc, err = got
    if isinstance(exc, TimeoutError):
        return Case(surface, name, False, "hang", str(exc))
    if exc is not None and not isinstance(exc, SystemExit):
        return Case(surface, name, False, f"traceback ({type(exc).__name__})", f"{type(exc).__name__}: {exc}"[:2000])
    if code in answers:
        return Case(surface, name, True, "accepted" if code == 0 else f"answered rc {code}")
    errors = [line for line in err.splitlines() if line.startswith("error")]
    if code != 2:
        return Case(surface, name, False, f"rc {code}", err[-2000:])
    if len(errors) != 1 or "Traceback" in err:
        return Case(surface, name, False, "not one line", err[-2000:])
    return Case(surface, name, True, "refused", errors[0][:300])


# --- bytes a reader must survive -------------------------------------------------------------------

HUGE_INT = "9" * 5000
DEEP = "[" * 100_000 + "]" * 100_000


def special(path: Path, kind: str) -> None:
    """Replace `path` with a symlink to /dev/zero, a FIFO, a directory, or a dangling/looping link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to(path.name)
    elif kind == "dangling":
        path.symlink_to(path.name + ".missing")
    elif kind == "empty":
        path.write_bytes(b"")


SPECIALS = ("devzero", "fifo", "dir", "loop", "dangling", "empty")


def json_mutations(data: dict, fields: list[tuple[str, ...]]) -> Iterator[tuple[str, Callable[[Path], None]]]:
    """Whole-file mutations of a JSON file, then bad values at each of `fields` (key paths)."""
    text = json.dumps(data)
    for name, raw in [
        ("invalid JSON", text[: len(text) // 2].encode()),
        ("deep nesting", DEEP.encode()),
        ("bad UTF-8", text.replace('"', '"\xff', 1).encode("latin-1")),
        ("not an object", b"[1, 2, 3]"),
        ("NaN literal", text.replace("{", '{"nan_key": NaN, ', 1).encode()),
        ("duplicate keys", text.replace("{", '{"dup": 1, "dup": 2, ', 1).encode()),
    ]:
        yield name, lambda p, raw=raw: p.write_bytes(raw)
    for kind in SPECIALS:
        yield f"as {kind}", lambda p, kind=kind: special(p, kind)
    for field in fields:
        for label, value in [
            ("huge int", None),
            ("string", "x"),
            ("negative", -1),
            ("zero", 0),
            ("list", [1, "a"]),
            ("null", None),
        ]:
            yield (
                f"{'.'.join(field)} = {label}",
                lambda p, field=field, label=label, value=value: _set(p, data, field, label, value),
            )


def _set(path: Path, data: dict, field: tuple[str, ...], label: str, value) -> None:
    d = json.loads(json.dumps(data))
    node = d
    for k in field[:-1]:
        node = node.setdefault(k, {})
    node[field[-1]] = "__HUGE__" if label == "huge int" else value
    path.write_text(json.dumps(d).replace('"__HUGE__"', HUGE_INT))


# --- model.toml ----------------------------------------------------------------------------------

TOML_KEYS = [
    ("model", "dtype"),
    ("model", "cache_quant"),
    ("target", "name"),
    ("target", "executable"),
    ("buckets", "batch"),
    ("buckets", "tokens"),
    ("buckets", "max_context"),
    ("kv", "block_size"),
    ("kv", "num_blocks"),
]
TOML_VALUES = ['"x"', "-1", "0", HUGE_INT, "nan", "inf", '[1, "a"]', "{ a = 1 }", "1e-300", '"' + "a" * 100_000 + '"']


def toml_cases(base: str, work: Path, compile_main) -> Iterator[Case]:
    lines = base.splitlines()
    mutated: list[tuple[str, bytes | str]] = []
    for section, key in TOML_KEYS:
        at = _toml_line(lines, section, key)
        for v in TOML_VALUES:
            new = list(lines)
            new[at] = f"{key} = {v}"
            mutated.append((f"[{section}] {key} = {v[:20]}", "\n".join(new)))
    mutated += [
        ("empty file", ""),
        ("invalid syntax", base.replace("]", "", 1)),
        ("bad UTF-8", base.encode() + b'\n# \xff\xfe\n[extra]\nx = "\xc3\x28"\n'),
        ("deep nesting", base + "\n[deep]\nx = " + "[" * 50_000 + "]" * 50_000 + "\n"),
        ("unknown section", base + "\n[nope]\nx = 1\n"),
        ("unknown key", base.replace("[kv]", "[kv]\nnot_a_key = 1")),
        ("missing [model]", base.split("[target]", 1)[1].join(["[target]", ""])),
        ("duplicate key", base.replace("[kv]", "[kv]\nblock_size = 16")),
        ("checkpoint missing", _replace_ckpt(base, "/nonexistent/ckpt")),
        ("checkpoint /dev/zero", _replace_ckpt(base, "/dev/zero")),
        ("checkpoint is a file", _replace_ckpt(base, "/etc/hostname")),
        ("tiny huge layers", base.replace("[model]", "[model]\ntiny = { seed = 0, layers = " + HUGE_INT + " }")),
        ("tiny negative seed", base.replace("[model]", "[model]\ntiny = { seed = -1, layers = 6 }")),
        ("parallel ep = 3", base + "\n[parallel]\ntp = 1\nep = 3\ncp = 1\n"),
        ("trn2 fallback = maybe", _trn2(base, '{ fallback = "maybe" }')),
        ("trn2 fallback = true", _trn2(base, "{ fallback = true }")),
        ("parallel tp = 0", base + "\n[parallel]\ntp = 0\nep = 1\ncp = 1\n"),
    ]
    for name, text in mutated:
        d = work / "toml" / str(abs(hash(name)))
        d.mkdir(parents=True, exist_ok=True)
        toml = d / "model.toml"
        toml.write_bytes(text if isinstance(text, bytes) else text.encode())
        yield judge_cli("model.toml", name, run_cli(compile_main, [str(toml), "--print-cache-key", "--no-cache"]))
    for kind in SPECIALS:
        d = work / "toml" / kind
        d.mkdir(parents=True, exist_ok=True)
        special(d / "model.toml", kind)
        yield judge_cli(
            "model.toml", f"model.toml as {kind}", run_cli(compile_main, [str(d / "model.toml"), "--print-cache-key"])
        )


def _toml_line(lines: list[str], section: str, key: str) -> int:
    current = None
    for i, line in enumerate(lines):
        if line.startswith("["):
            current = line.strip("[] ")
        elif current == section and line.split("=")[0].strip() == key:
            return i
    raise KeyError((section, key))


def _trn2(base: str, options: str) -> str:
    """`base` (the cpu target's model.toml) for trn2 with these [target] options."""
    target = base.replace('name = "cpu"', 'name = "trn2"', 1)
    return target.replace('executable = "exported"', f'executable = "neff"\noptions = {options}', 1)


def _replace_ckpt(base: str, path: str) -> str:
    return "\n".join(f'checkpoint = "{path}"' if line.startswith("checkpoint") else line for line in base.splitlines())


# --- checkpoint files ---------------------------------------------------------------------------


def copy_ckpt(src: Path, dst: Path) -> Path:
    """A checkpoint copy whose tensors file is a hard link (replaced, not edited, when mutated)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            os.link(f, dst / f.name)
        else:
            shutil.copyfile(f, dst / f.name)
    return dst


def header_mutations(raw: bytes) -> Iterator[tuple[str, bytes]]:
    """A safetensors file's bytes with its header changed."""
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    first = next(k for k in header if k != "__metadata__")

    def pack(h: bytes) -> bytes:
        return struct.pack("<Q", len(h)) + h + body

    def edit(fn) -> bytes:
        h = json.loads(json.dumps(header))
        fn(h)
        return pack(json.dumps(h).encode().replace(b'"__HUGE__"', HUGE_INT.encode()))

    yield "header length huge", struct.pack("<Q", 1 << 62) + raw[8:]
    yield "header length past the end", struct.pack("<Q", len(raw)) + raw[8:]
    yield "header not JSON", pack(b"{not json" + b" " * 16)
    yield "header deep nesting", pack(DEEP.encode())
    yield "__metadata__ deep", edit(lambda h: h.__setitem__("__metadata__", {"x": json.loads("[" * 500 + "]" * 500)}))
    yield "offsets huge int", edit(lambda h: h[first].__setitem__("data_offsets", ["__HUGE__", "__HUGE__"]))
    yield "offsets past the end", edit(lambda h: h[first].__setitem__("data_offsets", [0, len(body) * 4]))
    yield "offsets negative", edit(lambda h: h[first].__setitem__("data_offsets", [-8, 0]))
    yield "offsets reversed", edit(lambda h: h[first].__setitem__("data_offsets", h[first]["data_offsets"][::-1]))
    yield "dtype unknown", edit(lambda h: h[first].__setitem__("dtype", "Q7"))
    yield "shape wrong", edit(lambda h: h[first].__setitem__("shape", [3, 5, 7]))
    yield "shape negative", edit(lambda h: h[first].__setitem__("shape", [-1]))
    yield "tensor not an object", edit(lambda h: h.__setitem__(first, [1, 2]))
    dup = json.dumps(header).replace("{", "{" + f'"{first}": {json.dumps(header[first])}, ', 1)
    yield "duplicate tensor name", pack(dup.encode())
    yield "truncated file", raw[: 8 + n + len(body) // 2]


def checkpoint_cases(ckpt: Path, base_toml: str, work: Path, compile_main) -> Iterator[Case]:
    config = json.loads((ckpt / "config.json").read_text())
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    q = ("quantization_config",)
    config_fields = [
        ("text_config", "hidden_size"),
        ("text_config", "num_hidden_layers"),
        ("text_config", "vocab_size"),
    ]
    cases: list[tuple[str, str, Callable[[Path], None]]] = []
    for name, mutate in json_mutations(config, config_fields):
        cases.append((f"config.json {name}", "config.json", mutate))
    for field, value in [
        ("weight_block_size", [0, 0]),
        ("weight_block_size", [-1, 32]),
        ("weight_block_size", "x"),
        ("scale_fmt", "weird"),
        ("quant_method", "int3"),
        ("activation_scheme", "static"),
        ("expert_dtype", "fp2"),
    ]:
        cases.append((f"quantization_config.{field} = {value}", "config.json", _qc(config, q, field, value)))
    cases.append(("quantization_config missing", "config.json", _qc(config, q, None, None)))
    for name, mutate in json_mutations(index, [("metadata", "total_size")]):
        cases.append((f"index {name}", "model.safetensors.index.json", mutate))
    first = next(iter(index["weight_map"]))
    for label, target in [("a missing file", "nope.safetensors"), ("a directory", "."), ("itself", "../x")]:
        cases.append((f"index entry -> {label}", "model.safetensors.index.json", _index_to(index, first, target)))
    raw = (ckpt / "model.safetensors").read_bytes()
    for name, data in header_mutations(raw):
        cases.append((f"safetensors {name}", "model.safetensors", lambda p, data=data: p.write_bytes(data)))
    for kind in ("devzero", "fifo", "loop"):
        cases.append((f"model.safetensors as {kind}", "model.safetensors", lambda p, kind=kind: special(p, kind)))
    for i, (name, file, mutate) in enumerate(cases):
        d = copy_ckpt(ckpt, work / "ckpt" / str(i))
        target = d / file
        if file == "model.safetensors":
            target.unlink()  # a hard link to the original: never write through it
        mutate(target)
        toml = d.parent / f"{i}.toml"
        toml.write_text(_replace_ckpt(base_toml, str(d)))
        yield judge_cli("checkpoint", name, run_cli(compile_main, [str(toml), "--print-cache-key", "--no-cache"]))


def _qc(config: dict, q: tuple, field: str | None, value) -> Callable[[Path], None]:
    def mutate(p: Path) -> None:
        d = json.loads(json.dumps(config))
        if field is None:
            d.pop(q[0])
        else:
            d[q[0]][field] = value
        p.write_text(json.dumps(d))

    return mutate


def _index_to(index: dict, name: str, target: str) -> Callable[[Path], None]:
    def mutate(p: Path) -> None:
        d = json.loads(json.dumps(index))
        d["weight_map"][name] = target
        p.write_text(json.dumps(d))

    return mutate


# --- figures file (`deepinfer plan --figures`; `deepinfer doctor` writes it) ------------------------

FIGURES = {
    "deepinfer_figures": 1,
    "measured_on": {
        "host": "bench",
        "instance_type": None,
        "neuronx_cc": None,
        "libnrt": None,
        "lnc": 2,
        "when": "2026-12-06T12:00:00+00:00",
    },
    "figures": {"launch_s": {"value": 4e-05, "how": "bench"}, "hbm_bytes_per_s": {"value": 2.5e12, "how": "bench"}},
    "collectives": {"all_reduce": [[1024, 2e-05], [1048576, 6e-05]], "all_gather": [[1024, 2e-05]]},
}
FIGURE_FIELDS = [
    ("deepinfer_figures",),
    ("measured_on",),
    ("measured_on", "lnc"),
    ("measured_on", "when"),
    ("figures",),
    ("figures", "launch_s"),
    ("figures", "launch_s", "value"),
    ("figures", "launch_s", "how"),
    ("collectives", "all_reduce"),
]


def figures_cases(base: str, work: Path, deepinfer_main) -> Iterator[Case]:
    """The figures file mutated under `deepinfer plan --figures` of the tiny model for trn2: whole-file
    mutations, bad values at its keys, and what a measuring host might get wrong."""
    toml = work / "figures" / "model.toml"
    toml.parent.mkdir(parents=True, exist_ok=True)
    toml.write_text(base.replace('name = "cpu"\nexecutable = "exported"', 'name = "trn2"\nexecutable = "neff"'))
    text = json.dumps(FIGURES)
    named: list[tuple[str, Callable[[Path], None]]] = [
        ("version 2", lambda p: p.write_text(text.replace('"deepinfer_figures": 1', '"deepinfer_figures": 2'))),
        ("unknown figure", lambda p: p.write_text(text.replace('"launch_s"', '"launch_us"'))),
        ("unknown top-level key", lambda p: p.write_text(text.replace("{", '{"extra": 1, ', 1))),
        ("NaN value", lambda p: p.write_text(text.replace("4e-05", "NaN"))),
        ("Infinity value", lambda p: p.write_text(text.replace("4e-05", "Infinity"))),
        ("1e999 value", lambda p: p.write_text(text.replace("4e-05", "1e999"))),
        ("negative value", lambda p: p.write_text(text.replace("4e-05", "-4e-05"))),
        ("true as value", lambda p: p.write_text(text.replace("4e-05", "true"))),
        ("payload twice", lambda p: p.write_text(text.replace("1048576", "1024"))),
        ("pair of three", lambda p: p.write_text(text.replace("[1024, 2e-05]", "[1024, 2e-05, 3]", 1))),
        ("empty curve", lambda p: p.write_text(text.replace("[[1024, 2e-05]]}", "[]}"))),
        ("when not ISO", lambda p: p.write_text(text.replace("2026-12-06T12:00:00+00:00", "yesterday"))),
    ]
    for name, mutate in [*json_mutations(FIGURES, FIGURE_FIELDS), *named]:
        path = work / "figures" / "figures.json"
        special(path, "empty")  # whatever the previous case left there, a file again
        path.write_text(text)
        mutate(path)
        got = run_cli(deepinfer_main, ["plan", str(toml), "--no-scratch", "--no-cache", "--figures", str(path)])
        yield judge_cli("figures", name, got)
