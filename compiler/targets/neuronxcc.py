"""neuronx-cc orchestration: find the compiler, build its command line, run it for one region.

Pure functions (`find_compiler`, `NeuronCompileOptions.from_dict`, `command`) plus one
runner (`compile_neff`). The trn2 target calls `compile_neff` once per region; the
NEFF it writes is checked by `deepinfer.bundles.neff`.

Facts this module relies on (public sources, read 2026-08):

- CLI: `neuronx-cc compile <hlo.pb> --framework XLA --target trn2 ... --output f.neff`;
  `--model-type {generic,transformer,unet-inference}`, `--auto-cast {none,matmult,all}`
  (default `none` in current releases, `matmult` in early ones: we always pass it),
  `--optlevel N` / `-O N` with N in {1,2,3}, default 2; `--logical-nc-config N` /
  `-lnc N` with N in {1,2}, trn2 only, default 2 on trn2; `--logfile` (default
  `log-neuron-cc.txt` in the working directory); `--verbose
  {debug,info,warning,error,critical}` (default warning); exit status 0 on success,
  non-zero on any error.
  https://github.com/aws-neuron/aws-neuron-sdk/blob/master/compiler/neuronx-cc/api-reference-guide/index.rst
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/neuronx-cc/how-to-generate-neff.html
- `--lnc N` spelling: AWS's own error page and NxD Inference pass `--lnc`; the runtime's
  NEURON_LOGICAL_NC_CONFIG must equal the LNC a NEFF was compiled for; LNC 2 (two
  physical NeuronCore-v3 per logical core) is the trn2 default, trn1 accepts only 1.
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/error-codes/EARG001.html
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/logical-neuroncore-config.html
- `--workdir` is NOT in the current CLI reference (it appears only in archived
  tensorflow-neuronx notes), so we do not pass it: the compiler runs with its cwd in a
  per-job directory instead, and `--logfile` puts its diagnostic log there.
- `neuronx-cc --version` prints `NeuronX Compiler version 2.14.227.0+2d4f85be` on its
  first line, then Python/HWM/NumPy version lines.
  https://github.com/aws-neuron/aws-neuron-sdk/issues/947
  https://github.com/aws-neuron/aws-neuron-sdk/issues/754
- Errors are printed as `[ERROR] [NCC_EVRF029] Operation sort is not supported on trn2...`
  or `[INTERNAL_ERROR] [NCC_INLA001] Unhandled exception ...` (sometimes after a
  timestamp); codes are `NCC_` + a letter (E user error, I internal) + three letters +
  three digits. The compiler reports "Diagnostic logs stored in .../log-neuron-cc.txt".
  Older releases print a bracketed code of three letters and three digits instead:
  `2024-04-30T20:50:00Z [TEN404] (op) Internal tensorizer error: ...`; it is reported the same way.
  https://github.com/aws-neuron/aws-neuron-sdk/issues/881
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/error-codes/index.html
  https://github.com/vllm-project/vllm-neuron/issues/16
- The compiler ships as the `neuronx-cc` wheel in AWS's pip repository and runs on any
  x86_64 Linux host (no Trainium needed to compile).
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/neuronx-cc/how-to-generate-neff.html
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from deepinfer.errors import DeepinferError

ENV_COMPILER = "DEEPINFER_NEURONX_CC"
TARGET = "trn2"
VERSION_TIMEOUT_S = 60
COMPILER_LOG = "log-neuron-cc.txt"  # the compiler's own diagnostic log, in the job dir

LNC_CHOICES = (1, 2)
OPTLEVEL_CHOICES = (1, 2, 3)
MODEL_TYPES = ("generic", "transformer", "unet-inference")
AUTO_CAST_MODES = ("none", "matmult", "all")
VERBOSE_LEVELS = ("debug", "info", "warning", "error", "critical")
# Flags `command` owns; extra_flags may not repeat them (the later one would silently win).
MANAGED_FLAGS = (
    "--framework",
    "--target",
    "--lnc",
    "--logical-nc-config",
    "-lnc",
    "--optlevel",
    "-O",
    "--model-type",
    "--auto-cast",
    "--output",
    "--logfile",
    "--verbose",
)

MISSING_MESSAGE = (
    f"neuronx-cc not found on PATH or {ENV_COMPILER}; it ships with the Neuron SDK (pip install "
    "neuronx-cc from the Neuron pip repository https://pip.repos.neuron.amazonaws.com, on any "
    "x86_64 Linux host, no Trn2 needed to compile); or use an HLO-stage bundle and "
    "`deepinfer-compile --finish BUNDLE` later"
)

_VERSION_RE = re.compile(r"NeuronX Compiler version\s+([0-9][^\s]*)")
# `NCC_EVRF029` (bracketed or not), or the older bracketed `[TEN404]` form (three letters, three digits)
_NCC_CODE_RE = re.compile(r"\[?\b(NCC_[A-Z]{3,6}[0-9]{3,4})\b\]?|\[([A-Z]{3}[0-9]{3})\]")
_MAX_LINE = 400
_LOG_SEPARATOR = f"# ---- {COMPILER_LOG} (the compiler's own log) ----"


class NeuronCompilerMissing(DeepinferError):
    """neuronx-cc is not installed here (or DEEPINFER_NEURONX_CC points nowhere)."""


class NeuronCompileError(DeepinferError):
    """neuronx-cc ran and failed, timed out, or wrote no NEFF."""


class NeuronRefused(NeuronCompileError):
    """neuronx-cc exited non-zero with an error code (`NCC_IBIR297`, or the older `[TEN404]`): it
    refused the module of executable `region`. Both travel with the message (as its args, so that
    it pickles: a compile worker raises it)."""

    def __init__(self, message: str, code: str, region: str) -> None:
        super().__init__(message, code, region)
        self.code = code
        self.region = region

    def __str__(self) -> str:
        return str(self.args[0])

    def noted(self, note: str) -> NeuronRefused:
        """The same refusal with `note` before its closing `(log: ...)`."""
        head, sep, log = str(self).rpartition(" (log: ")
        return NeuronRefused(f"{head}; {note}{sep}{log}" if sep else f"{self}; {note}", self.code, self.region)


# --- finding the compiler ---


def find_compiler() -> str | None:
    """$DEEPINFER_NEURONX_CC if set (must be an executable file), else `neuronx-cc` on PATH."""
    explicit = os.environ.get(ENV_COMPILER)
    if explicit:
        path = Path(explicit).expanduser()
        return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    return shutil.which("neuronx-cc")


_VERSIONS: dict[tuple[str, int], str] = {}


def compiler_version(path: str) -> str:
    """The version `<path> --version` reports, e.g. "2.14.227.0+2d4f85be" (cached per path + mtime)."""
    resolved = str(Path(path).resolve())
    try:
        key = (resolved, os.stat(resolved).st_mtime_ns)
    except OSError:
        raise NeuronCompilerMissing(f"{path}: {MISSING_MESSAGE}") from None
    if key in _VERSIONS:
        return _VERSIONS[key]
    try:
        proc = subprocess.run(
            [path, "--version"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=VERSION_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise NeuronCompileError(f"`{path} --version` did not answer within {VERSION_TIMEOUT_S} s") from None
    except OSError as e:
        raise NeuronCompilerMissing(f"{path}: cannot run it ({e.strerror}); {MISSING_MESSAGE}") from None
    match = _VERSION_RE.search(proc.stdout + "\n" + proc.stderr)
    if not match:
        first = next((ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()), "")
        raise NeuronCompileError(
            f"`{path} --version` printed no 'NeuronX Compiler version' line "
            f"(exit {proc.returncode}, first line {first[:_MAX_LINE]!r}); "
            f"is {path} neuronx-cc?"
        )
    _VERSIONS[key] = match.group(1)
    return match.group(1)


# --- options ---


@dataclass(frozen=True, kw_only=True)
class NeuronCompileOptions:
    """model.toml [target].options for trn2. Defaults follow the CLI reference except auto_cast
    ("none": deepinfer chooses every dtype itself, so the compiler must not downcast)."""

    lnc: int = 2  # trn2's documented default (--logical-nc-config)
    optlevel: int = 2  # the compiler's default
    model_type: str = "transformer"
    auto_cast: str = "none"
    extra_flags: tuple[str, ...] = ()  # passed through verbatim, after ours
    verbose: str | None = None  # None: the compiler's default (warning)
    timeout_s: float = 3600.0

    @classmethod
    def from_dict(cls, options: dict) -> NeuronCompileOptions | str:
        """Validated options, or a one-line message naming the bad key/value and what is valid."""
        valid = [f.name for f in fields(cls)]
        unknown = [k for k in options if k not in valid]
        if unknown:
            return f"unknown neuronx-cc option {unknown[0]!r}; valid options: {', '.join(valid)}"
        choices = {
            "lnc": LNC_CHOICES,
            "optlevel": OPTLEVEL_CHOICES,
            "model_type": MODEL_TYPES,
            "auto_cast": AUTO_CAST_MODES,
            "verbose": VERBOSE_LEVELS,
        }
        for key, allowed in choices.items():
            if key in options and not _one_of(options[key], allowed):
                return f"option {key} = {options[key]!r} is not one of {', '.join(map(repr, allowed))}"
        kwargs = dict(options)
        if "extra_flags" in kwargs:
            flags = kwargs["extra_flags"]
            if not isinstance(flags, (list, tuple)) or not all(isinstance(f, str) for f in flags):
                return f"option extra_flags = {flags!r} must be a list of strings"
            owned = [f for f in flags if _managed(f)]
            if owned:
                return (
                    f"option extra_flags contains {owned[0]!r}, which deepinfer sets itself; "
                    f"use the options {', '.join(k for k in valid if k != 'extra_flags')} instead"
                )
            kwargs["extra_flags"] = tuple(flags)
        if "timeout_s" in kwargs:
            t = kwargs["timeout_s"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
                return f"option timeout_s = {t!r} must be a positive number of seconds"
            kwargs["timeout_s"] = float(t)
        return cls(**kwargs)

    def keyed(self) -> dict:
        """The options that change the NEFF (for cache keys)."""
        return {k: getattr(self, k) for k in KEYED}


# Every option is in exactly one of these (tested): KEYED options change the NEFF and enter
# cache keys; LOG_ONLY ones change only what is logged or how long we wait for it.
KEYED = ("lnc", "optlevel", "model_type", "auto_cast", "extra_flags")
LOG_ONLY = ("verbose", "timeout_s")


def _one_of(value, allowed: tuple) -> bool:
    # bool is an int: lnc = true must not pass as 1
    return not isinstance(value, bool) and value in allowed and type(value) is type(allowed[0])


def _managed(flag: str) -> bool:
    name = flag.split("=", 1)[0]
    return name in MANAGED_FLAGS or (flag.startswith("-O") and not flag.startswith("--"))


# --- the command ---


def command(compiler: str, hlo_path: Path, neff_path: Path, opts: NeuronCompileOptions, workdir: Path) -> list[str]:
    """The neuronx-cc argv for one HLO module -> one NEFF; the compiler's own log goes to workdir."""
    argv = [
        compiler,
        "compile",
        str(hlo_path),
        "--framework",
        "XLA",
        "--target",
        TARGET,
        "--lnc",
        str(opts.lnc),
        "--model-type",
        opts.model_type,
        f"-O{opts.optlevel}",
        "--auto-cast",
        opts.auto_cast,
        "--logfile",
        str(Path(workdir) / COMPILER_LOG),
    ]
    if opts.verbose is not None:
        argv += ["--verbose", opts.verbose]
    return [*argv, "--output", str(neff_path), *opts.extra_flags]


# --- running it ---


def compile_neff(
    hlo_path: Path,
    neff_path: Path,
    log_path: Path,
    opts: NeuronCompileOptions,
    *,
    region: str,
    compiler: str | None = None,
) -> Path:
    """Compile `hlo_path` into `neff_path` (written atomically); the full log is kept at `log_path`.

    Raises NeuronCompilerMissing without a compiler, NeuronCompileError (one line naming the
    region and the log) when it fails, times out, or writes no NEFF.
    """
    compiler = compiler or find_compiler()
    if compiler is None:
        explicit = os.environ.get(ENV_COMPILER)
        raise NeuronCompilerMissing(
            (f"{ENV_COMPILER}={explicit} is not an executable file; " if explicit else "") + MISSING_MESSAGE
        )
    hlo_path, neff_path, log_path = Path(hlo_path).resolve(), Path(neff_path).resolve(), Path(log_path).resolve()
    if not hlo_path.is_file():
        raise NeuronCompileError(f"region {region}: HLO module {hlo_path} does not exist")
    neff_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # the job directory sits beside the NEFF so the final rename stays on one filesystem
    workdir = Path(tempfile.mkdtemp(prefix=f".{neff_path.name}.", dir=neff_path.parent))
    try:
        staged = workdir / neff_path.name
        argv = command(compiler, hlo_path, staged, opts, workdir)
        try:
            returncode = _run_logged(argv, workdir, log_path, opts.timeout_s, region)
        finally:
            _append_compiler_log(workdir / COMPILER_LOG, log_path)
        if returncode != 0:
            message, code = _failure(region, returncode, log_path)
            raise NeuronRefused(message, code, region) if code else NeuronCompileError(message)
        if not staged.is_file() or staged.stat().st_size == 0:
            raise NeuronCompileError(f"region {region}: neuronx-cc exited 0 but wrote no NEFF (log: {log_path})")
        os.replace(staged, neff_path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return neff_path


def _run_logged(argv: list[str], workdir: Path, log_path: Path, timeout_s: float, region: str) -> int:
    """Run argv in workdir with stdout+stderr streamed to log_path; returns the exit status."""
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"# deepinfer: region {region}\n# cwd: {workdir}\n# {shlex.join(argv)}\n")
        log.flush()
        try:
            # own process group: neuronx-cc starts helper processes, a timeout must stop them all
            proc = subprocess.Popen(
                argv,
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:
            raise NeuronCompilerMissing(f"{argv[0]}: cannot run it ({e.strerror}); {MISSING_MESSAGE}") from None
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            log.write(f"\n# deepinfer: killed after {timeout_s:g} s\n")
            raise NeuronCompileError(
                f"region {region}: neuronx-cc timed out after {timeout_s:g} s (log: {log_path})"
            ) from None
        except BaseException:
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _append_compiler_log(compiler_log: Path, log_path: Path) -> None:
    """Keep the compiler's own diagnostic log: it is deleted with the job directory."""
    if not compiler_log.is_file():
        return
    with open(log_path, "a", encoding="utf-8") as log, open(compiler_log, encoding="utf-8", errors="replace") as src:
        log.write(f"\n{_LOG_SEPARATOR}\n")
        shutil.copyfileobj(src, log)


def _failure_message(region: str, returncode: int, log_path: Path) -> str:
    """The first NCC_ error line (console output first, then the compiler's log), else the
    last console line."""
    return _failure(region, returncode, log_path)[0]


def _failure(region: str, returncode: int, log_path: Path) -> tuple[str, str | None]:
    """`_failure_message`'s line and the error code it quotes (None: no code in the output)."""
    text = log_path.read_text(encoding="utf-8", errors="replace")
    console = text.split(_LOG_SEPARATOR, 1)[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("# ")]
    for i, line in enumerate(lines):
        match = _NCC_CODE_RE.search(line)
        if match:
            text = line[match.end() :].lstrip(" :-").rstrip()
            if not text and i + 1 < len(lines):  # message on the next line
                text = lines[i + 1]
            code = match.group(1) or match.group(2)
            return f"region {region}: neuronx-cc failed with {code}: {_clip(text)} (log: {log_path})", code
    console_lines = [ln.strip() for ln in console.splitlines() if ln.strip() and not ln.startswith("# ")]
    last = console_lines[-1] if console_lines else "(no output)"
    return f"region {region}: neuronx-cc failed (exit {returncode}): {_clip(last)} (log: {log_path})", None


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_LINE else text[: _MAX_LINE - 3] + "..."
