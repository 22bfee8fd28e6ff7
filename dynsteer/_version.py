"""dynsteer's version, in a module of its own so that the engine can report it without importing the package face."""

__version__ = "0.1.0"
