"""Decoupled DiLoCo: the shared package (core algorithm, training task, simulator, gRPC plumbing, CLI)."""

__version__ = "0.1.0"
