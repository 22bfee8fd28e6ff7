"""The package version, in a module of its own: the engine room reports it without importing the package face."""

__version__ = "0.1.0"
