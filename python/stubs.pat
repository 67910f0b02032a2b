# Patterns for nanobind's stubgen (scripts/stubs.sh): what it does not write by itself.
# The module's version string (stubgen leaves out dunder attributes; the package re-exports it).
_cascade.__suffix__:
    __version__: str
