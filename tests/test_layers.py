"""The package's layering: the bundle is the only contract between compiler and runtime.

Every deepinfer module is read (its imports, module-level and inside
functions) and placed in a layer; a module may import its own layer or lower
ones, never a higher one. `import deepinfer.runtime` is checked in a fresh
interpreter against the exact set of modules it may load.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import deepinfer
import deepinfer.runtime
from deepinfer.compiler.cache.keys import import_closure, module_imports

# lowest first: a module may import its own layer and those below it
LAYERS = [
    (
        "format",
        [
            "deepinfer",
            "deepinfer.errors",
            "deepinfer.reader",
            "deepinfer.schema",
            "deepinfer.host",
            "deepinfer.units",
            "deepinfer.bundles",
        ],
    ),
    ("numerics", ["deepinfer.quant", "deepinfer.kernels"]),
    ("model family", ["deepinfer.regions"]),
    ("compiler and runtime", ["deepinfer.compiler", "deepinfer.runtime"]),
    (
        "tools",
        ["deepinfer.compare", "deepinfer.diff", "deepinfer.cli_common", "deepinfer.doctor", "deepinfer.doctor_stages"],
    ),
    (
        "commands",
        [
            "deepinfer.cli",
            "deepinfer.cache_cli",
            "deepinfer.compare_cli",
            "deepinfer.doctor_cli",
            "deepinfer.plan_cli",
            "deepinfer.__main__",
            "deepinfer.compiler.cli",
            "deepinfer.runtime.cli",
            "deepinfer.runtime.serving.cli",
        ],
    ),
]
# what `import deepinfer.runtime` loads: the format, the shared step of the model family, the runtime
RUNTIME_LOADS = [
    "deepinfer",
    "deepinfer.bundles",
    "deepinfer.bundles.layout",
    "deepinfer.bundles.manifest",
    "deepinfer.bundles.manifest_checks",
    "deepinfer.bundles.manifest_io",
    "deepinfer.bundles.pt2",
    "deepinfer.bundles.safetensors",
    "deepinfer.bundles.signatures",
    "deepinfer.bundles.signing",
    "deepinfer.bundles.topology",
    "deepinfer.bundles.verified",
    "deepinfer.errors",
    "deepinfer.host",
    "deepinfer.reader",
    "deepinfer.regions",
    "deepinfer.regions.config",
    "deepinfer.regions.engram_hash",
    "deepinfer.regions.micro",  # a divided chunk's micro-batches (the executor drives them)
    "deepinfer.regions.prefix",
    "deepinfer.regions.spans",
    "deepinfer.regions.step",
    "deepinfer.regions.stepper",
    "deepinfer.regions.tokenizer",
    "deepinfer.regions.topology",  # the layout's pure functions: the engram's methods, what a boundary sums
    "deepinfer.runtime",
    "deepinfer.runtime.api",
    "deepinfer.runtime.backends",
    "deepinfer.runtime.budget",  # the scheduler's token budget a step
    "deepinfer.runtime.bundle",
    "deepinfer.runtime.draft",
    "deepinfer.runtime.executor",
    "deepinfer.runtime.generation",
    "deepinfer.runtime.loading",
    "deepinfer.runtime.options",
    "deepinfer.runtime.prefix_gen",  # the scheduler's prefix caching at a step's end
    "deepinfer.runtime.requests",
    "deepinfer.runtime.sampling",
    "deepinfer.runtime.schedule",
    "deepinfer.runtime.slot_store",  # prefix caching's slot states on every rank (the executor's followers)
    "deepinfer.runtime.stats",  # what a run measured (the executor's Stats)
    "deepinfer.schema",
]
REGION_CLASSES = [
    "deepinfer.regions.attention",
    "deepinfer.regions.moe",
    "deepinfer.regions.engram",
    "deepinfer.regions.head",
    "deepinfer.regions.base",
    "deepinfer.regions.plan",
    "deepinfer.regions.selection",
]
MOVED = [
    "deepinfer.bundles.keys",
    "deepinfer.bundles.cache",
    "deepinfer.runtime.scheduler",
    "deepinfer.runtime.mmap_weights",
    "deepinfer.quant.safetensors_io",
    "deepinfer.regions.generate",
    "deepinfer.runtime.session",
    "deepinfer.runtime.nrt",
    "deepinfer.runtime.neuron_bundle",
    "deepinfer.runtime.neuron_ranks",
    "deepinfer.runtime.arrival",
]


def all_modules() -> list[str]:
    found = ["deepinfer"]
    for info in pkgutil.walk_packages(deepinfer.__path__, "deepinfer."):
        found.append(info.name)
    for package in ("compiler", "regions", "kernels", "quant", "runtime", "bundles"):
        pkg = importlib.import_module(f"deepinfer.{package}")
        found += [f"deepinfer.{package}"] + [
            i.name for i in pkgutil.walk_packages(pkg.__path__, f"deepinfer.{package}.")
        ]
    return sorted(set(found))


def layer(module: str) -> int:
    """The layer of the most specific entry naming `module` or a package above it."""
    best, depth = None, -1
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if (
                (module == n or module.startswith(n + "."))
                and n.count(".") > depth
                and not (n == "deepinfer" and module != "deepinfer")
            ):
                best, depth = i, n.count(".")
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def test_every_module_is_found():
    modules = all_modules()
    assert "deepinfer.compiler.targets.trn2" in modules and "deepinfer.runtime.executor" in modules
    assert len(modules) > 60


def test_no_module_imports_a_layer_above_it():
    bad = []
    for m in all_modules():
        for dep in module_imports(m):
            if layer(dep) > layer(m):
                bad.append(f"{m} ({LAYERS[layer(m)][0]}) imports {dep} ({LAYERS[layer(dep)][0]})")
    assert not bad, "\n".join(bad)


def test_compiler_and_runtime_never_import_each_other():
    for m in all_modules():
        deps = module_imports(m)
        if m.startswith("deepinfer.runtime"):
            assert not [d for d in deps if d.startswith("deepinfer.compiler")], m
        if m.startswith("deepinfer.compiler") and m != "deepinfer.compiler.cli":
            assert not [d for d in deps if d.startswith("deepinfer.runtime")], m
    # nor through anything they reach
    runtime = import_closure(("deepinfer.runtime", "deepinfer.runtime.cli"))
    assert not [m for m in runtime if m.startswith("deepinfer.compiler") or m in ("deepinfer.cli", "deepinfer.diff")]
    assert not set(REGION_CLASSES) & set(runtime)


def test_the_neuron_runtime_is_a_leaf_of_the_runtime():
    """runtime/neuron/ (the libnrt binding and what runs on it) imports no other runtime module: the
    runtime reaches it where a trn2 bundle runs or ranks start, never the reverse."""
    neuron = [m for m in all_modules() if m.startswith("deepinfer.runtime.neuron.")]
    assert {"deepinfer.runtime.neuron.libnrt", "deepinfer.runtime.neuron.placement"} <= set(neuron)
    for m in neuron:
        runtime = [d for d in module_imports(m) if d.startswith("deepinfer.runtime")]
        assert all(d.startswith("deepinfer.runtime.neuron") for d in runtime), (m, runtime)


def test_sub_commands_do_not_import_the_umbrella():
    for m in ("deepinfer.compiler.cli", "deepinfer.runtime.cli"):
        assert "deepinfer.cli" not in import_closure((m,)), m


def test_import_runtime_loads_only_the_contract():
    code = (
        "import sys, json; import deepinfer.runtime; "
        "print(json.dumps(sorted(m for m in sys.modules if m == 'deepinfer' or m.startswith('deepinfer.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == RUNTIME_LOADS
    assert not [m for m in loaded if m.startswith(("deepinfer.compiler", "deepinfer.kernels"))]


@pytest.mark.parametrize("module", MOVED)
def test_moved_modules_leave_no_shim(module):
    assert importlib.util.find_spec(module) is None


def test_the_model_family_does_not_know_the_bundle_layout():
    """The bundle's paths are the runtime's and the compiler's: no regions module reads bundles.layout
    (a bundle's tokenizer folder is read by runtime/bundle.py only)."""
    for m in all_modules():
        if m.startswith("deepinfer.regions"):
            assert "deepinfer.bundles.layout" not in module_imports(m), m


def test_a_bundle_keeps_the_checkpoint_tokenizer_names():
    """The bundle's tokenizer folder holds the checkpoint's tokenizer files under their own names: the
    bundle format's list and the model family's are the same."""
    from deepinfer.bundles import layout
    from deepinfer.regions import tokenizer

    assert layout.TOKENIZER_FILES == tokenizer.TOKENIZER_FILES
    assert layout.TOKENIZER_FILE == tokenizer.TOKENIZER_FILE


def _mutable_attributes(cls: ast.ClassDef) -> set[str]:
    """What instances of a class can change: every `self.x = ...` (or augmented, or a tuple target) in its
    methods, and the fields of a dataclass that is not frozen."""
    names: set[str] = set()
    frozen = any(
        isinstance(d, ast.Call) and any(k.arg == "frozen" and getattr(k.value, "value", False) for k in d.keywords)
        for d in cls.decorator_list
    )
    dataclass = any(
        (isinstance(d, ast.Name) and d.id == "dataclass")
        or (isinstance(d, ast.Call) and getattr(d.func, "id", None) == "dataclass")
        for d in cls.decorator_list
    )
    if dataclass and not frozen:
        names |= {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


def test_no_runtime_class_has_more_than_12_mutable_attributes():
    """What a loaded bundle is stays frozen (`Executor`); what a run changes lives in small objects."""
    root = Path(deepinfer.runtime.__path__[0])
    counts = {}
    for path in sorted(root.rglob("*.py")):  # the subpackages' too (runtime/neuron/)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                counts[f"{path.relative_to(root).as_posix()}:{node.name}"] = len(_mutable_attributes(node))
    assert counts["executor.py:Executor"] == 0 and counts["serving/engine.py:Engine"] > 0
    assert max(counts.values()) <= 12, {k: v for k, v in counts.items() if v > 12}


def test_one_scheduler():
    """Batch generation, serving and speculation share one loop: nothing else defines a generation loop."""
    for package in ("regions", "runtime"):
        root = Path(importlib.import_module(f"deepinfer.{package}").__path__[0])
        for path in root.rglob("*.py"):
            assert "def greedy" not in path.read_text(), path
