"""deepinfer: ahead-of-time compiler toolchain for DeepSeek-V4.1-class MoE models.

The package's subpackages live in the repository's top-level folders
(`compiler/`, `regions/`, `kernels/`, `quant/`, `runtime/`, `bundles/`) and are
mapped into the `deepinfer.*` namespace by `pyproject.toml`.
"""

__version__ = "0.1.0"
