# Patterns for nanobind's stubgen (scripts/stubs.sh): what it does not write by itself.
# `Array`, the name the bindings give their array arguments and results (python/src/typed.hpp): a structural
# type that NumPy arrays and PyTorch tensors both satisfy, so neither library is needed to read the stubs.
_cascade.__prefix__:
    from typing import Any, Protocol
    class Array(Protocol):
        """A NumPy array or a PyTorch CPU tensor (float32, float16 or bfloat16 elements where a kernel reads it;
        int8 codes and float16 scales in a Q8_0)."""
        @property
        def shape(self) -> Any: ...
        @property
        def dtype(self) -> Any: ...
# The module's version string (stubgen leaves out dunder attributes; the package re-exports it).
_cascade.__suffix__:
    __version__: str
