"""Test helpers: tiny random-weight checkpoints that vLLM loads offline."""

from dynsteer.testing.tiny_models import CPU_LOADABLE, TINY_ARCHS, TINY_SHAPE, tiny_model

__all__ = ["CPU_LOADABLE", "TINY_ARCHS", "TINY_SHAPE", "tiny_model"]
