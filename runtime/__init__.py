"""deepinfer.runtime: load a bundle and generate with it (`deepinfer-run`) or serve it (`deepinfer-serve`).

    from deepinfer.runtime import RunOptions, generate
    completions = generate("build/tiny", [[0, 72, 105]], RunOptions(max_new_tokens=8))

Depends only on the bundle format (deepinfer.bundles), the step contract of the model family
(deepinfer.regions.step, .stepper, .spans) and its own backends: never on the compiler or a region
class (tests/test_layers.py holds it to that).
"""

from deepinfer.runtime.api import generate, serve
from deepinfer.runtime.bundle import Bundle, open_bundle
from deepinfer.runtime.executor import Executor, Stats
from deepinfer.runtime.loading import load
from deepinfer.runtime.options import LoadOptions, RunOptions, ServeOptions
from deepinfer.runtime.requests import Completion, Completions

__all__ = [
    "Bundle",
    "Completion",
    "Completions",
    "Executor",
    "LoadOptions",
    "RunOptions",
    "ServeOptions",
    "Stats",
    "generate",
    "load",
    "open_bundle",
    "serve",
]
