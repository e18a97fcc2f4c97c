"""Data only: typed specs (models, GPUs, tiers, cluster layouts) and their YAML files. See ``configs.loader``."""

from configs.loader import (
    ConfigError,
    UnknownNameError,
    load_gpus,
    load_models,
    load_tiers,
    pick,
)
from configs.schema import GpuProfile, LinearStateSpec, ModelSpec, TierSpec

__all__ = [
    "ConfigError",
    "GpuProfile",
    "LinearStateSpec",
    "ModelSpec",
    "TierSpec",
    "UnknownNameError",
    "load_gpus",
    "load_models",
    "load_tiers",
    "pick",
]
