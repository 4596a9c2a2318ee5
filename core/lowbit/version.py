"""lowbit's version: its installed distribution's (pyproject.toml says it once)."""
import importlib.metadata

try:
    __version__ = importlib.metadata.version("lowbit")
except importlib.metadata.PackageNotFoundError:  # a source tree on the path, not installed
    __version__ = "0+unknown"
