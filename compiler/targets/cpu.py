"""The cpu target: AOTInductor packages (or saved ExportedPrograms) run in-process.

Lowering inlines every deepinfer kernel's pure-torch reference before
Inductor sees the graph, so Inductor fuses it: an opaque custom-op call from
compiled code would go back through Python.
"""

from __future__ import annotations

import functools
import json
import platform
import subprocess
import types
import typing
from pathlib import Path
from typing import ClassVar

import torch

import deepinfer
from deepinfer.bundles.pt2 import load_exported, normalize_package, save_exported
from deepinfer.compiler.trace import concrete_inputs
from deepinfer.host import physical_memory
from deepinfer.kernels import reference_decompositions


class CpuTarget:
    name: ClassVar[str] = "cpu"
    recipe: ClassVar[str] = "release"  # the weight recipe [quant] recipe = "target" means
    EXECUTABLES: ClassVar[tuple[str, ...]] = ("aoti", "exported")
    suffix: ClassVar[str] = ".pt2"
    lowered_suffix: ClassVar[str] = ".pt2"
    static_shapes: ClassVar[bool] = False
    state_writes: ClassVar[str] = "in-place"
    # the host lookup: host memory is the executables' memory, so a region saves no transfer.
    # Measured per step at hidden 5120 bf16, 1 thread: host 16-18 us at batch 1 (59-69 us at 8);
    # as a region, an AOTInductor package 6 us (36 us) but one more C++ compile per bucket, a
    # saved ExportedProgram 235 us (383 us). [host] embedding = false makes it a region.
    device_embedding: ClassVar[bool] = False
    graph_collectives: bool = False  # the ranks reduce on the host (runtime/ranks.py over gloo)
    fused_layers: bool = False  # one executable per region call: Inductor fuses inside each
    LOWERING_MODULES: ClassVar[tuple[str, ...]] = ("deepinfer.compiler.targets.cpu",)
    # options are Inductor config settings (aoti); these only write logs or dumps, so cache
    # keys leave them out (compiler/cache/keys.py). Every other option is keyed.
    LOG_OPTIONS: ClassVar[tuple[str, ...]] = (
        "trace.enabled",
        "trace.debug_dir",
        "trace.debug_log",
        "trace.info_log",
        "trace.fx_graph",
        "trace.fx_graph_transformed",
        "trace.ir_pre_fusion",
        "trace.ir_post_fusion",
        "trace.output_code",
        "trace.graph_diagram",
        "trace.log_autotuning_results",
        "trace.compile_profile",
        "verbose_progress",
    )

    lnc = None
    check = False  # AOTInductor compiles the traced graph itself: nothing to check

    def __init__(self, executable: str = "aoti", options: dict | None = None):
        self.executable = executable
        self.options = dict(options or {})

    @staticmethod
    def check_options(options: dict) -> str | None:
        """A message for the first option Inductor does not know, or whose value is not of the type
        Inductor declares for it (`cpp.simdlen = "8"`: a string where an int is expected), else None."""
        known = torch._inductor.config.get_config_copy()
        bad = [k for k in options if k not in known]
        if bad:
            return f"unknown Inductor option {bad[0]!r} (see torch._inductor.config)"
        for key, value in options.items():
            expected = inductor_option_type(key, known[key])
            if _fits(value, expected) is False:
                return (
                    f"Inductor option {key!r} = {json.dumps(value, default=str)} is a TOML {_toml_kind(value)}; "
                    f"Inductor expects {_type_name(expected)} (see torch._inductor.config)"
                )
        return None

    def keyed_options(self) -> dict:
        return {k: v for k, v in self.options.items() if k not in self.LOG_OPTIONS}

    def toolchain(self) -> dict[str, str]:
        versions = {
            "deepinfer": deepinfer.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        }
        if self.executable == "aoti":
            versions["cxx"] = _cxx_version()
            versions["threads"] = str(codegen_threads(self.options))
        return versions

    def step_figures(self) -> None:
        """No decode step cost model: the host's figures are the running machine's."""
        return None

    def device_memory(self) -> tuple[int | None, str]:
        """A cpu rank runs in host memory: this host's, unless [memory] limit_gib names another's."""
        return physical_memory(), "cpu: this host's memory; set [memory] limit_gib for the host that runs the bundle"

    def check_numerics(self, *args, **kwargs) -> dict:
        raise NotImplementedError("the cpu target has no lowering to check")

    def lower(self, ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        return ep.run_decompositions(reference_decompositions())

    def emit(
        self,
        ep: torch.export.ExportedProgram,
        names: list[str],
        outputs: list[str],
        out: Path,
        reduce: dict[str, list[list[int]]] | None = None,
    ) -> dict:
        """Save the lowered program for a compile job; state is written in place (no extra outputs).
        Its ranks reduce on the host: `reduce` must be empty."""
        if reduce:
            raise ValueError("the cpu target reduces on the host; no collective goes into its programs")
        save_exported(ep, out)  # the same bytes in every process: an exported bundle is the lowered file
        return {}

    def require_compiler(self) -> None:
        """AOTInductor ships with torch: nothing to look for."""

    def describe(self, executable: Path) -> dict:
        return {}

    def compile(self, lowered: Path, out: Path, *, log: Path | None = None, name: str = "") -> None:
        """`lowered`: a saved ExportedProgram -> the executable at `out`."""
        if self.executable == "exported":
            out.write_bytes(Path(lowered).read_bytes())
            return
        ep = load_exported(lowered)
        concrete_inputs(ep)  # saved programs carry shapes, not sample data
        torch._inductor.aoti_compile_and_package(ep, package_path=str(out), inductor_configs=self.options or None)
        normalize_package(out)  # its bytes: the program's, not the compile's history (bundles/pt2.py)


def codegen_threads(options: dict) -> int:
    """The thread count Inductor writes into an AOTInductor package's C++ (its OpenMP loops and GEMM
    blockings): the `cpp.threads` option where set, else this process's torch threads. Keyed with
    the toolchain, and the compile's workers take the leader's (`compiler.jobs.run_jobs`), so one
    key always names the same bytes."""
    threads = options.get("cpp.threads", -1)
    return threads if isinstance(threads, int) and threads >= 1 else torch.get_num_threads()


@functools.cache
def _cxx_version() -> str:
    """The first line of the C++ compiler's --version (AOTInductor builds with it)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    cxx = get_cpp_compiler()
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{cxx} (version unknown)"
    return out.splitlines()[0].strip() if out else f"{cxx} (version unknown)"


def inductor_option_type(key: str, default: object) -> object:
    """The type Inductor declares for option `key` (torch._inductor.config's entry for it; the type of
    its default where the entry says nothing)."""
    # torch's table of typed config entries (a ConfigModule's, which its stubs do not declare)
    entry = torch._inductor.config._config.get(key)  # type: ignore[attr-defined]
    declared = entry.value_type if entry is not None else None
    return declared if declared not in (None, type(None)) else type(default)


def _fits(value: object, expected: object) -> bool | None:
    """Whether a TOML value fits the declared type; None where it cannot be told (a callable, a class)."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        fits = [_fits(value, a) for a in args]
        return True if True in fits else (None if None in fits else False)
    if origin is typing.Literal:
        return value in args
    if expected is type(None):
        return value is None  # TOML has no null
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is str:
        return isinstance(value, str)
    if expected in (list, tuple) or origin in (list, tuple):
        return _fits_items(value, origin or expected, args)
    if expected is dict or origin is dict:
        return isinstance(value, dict)
    return None


def _fits_items(value: object, kind: object, args: tuple) -> bool | None:
    """A TOML array against list[X], tuple[X, ...] or tuple[X, Y]."""
    if not isinstance(value, list):
        return False
    if not args:
        return True
    if kind is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            return False
        fits = [_fits(v, a) for v, a in zip(value, args, strict=True)]
    else:
        fits = [_fits(v, args[0]) for v in value]
    return False if False in fits else (None if None in fits else True)


def _type_name(expected: object) -> str:
    return expected.__name__ if isinstance(expected, type) else str(expected).replace("typing.", "")


def _toml_kind(value: object) -> str:
    """How TOML calls the kind of a value."""
    kinds = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}
    return kinds.get(type(value), type(value).__name__)
