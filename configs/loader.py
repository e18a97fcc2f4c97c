"""Load the YAML spec files into typed objects; the only place in kvstack that parses config YAML.

Called by entrypoints (the ``kvstack`` CLI, app builders, the simulator) once; the parsed objects are passed down.
Errors name the file and the offending key (``ConfigError``); a lookup of an unknown name raises
``UnknownNameError`` listing the known names.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from configs.schema import GpuProfile, ModelSpec, TierSpec

SPECS_DIR = Path(__file__).resolve().parent / "specs"

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A config file is malformed: the message names the file and the key."""


class UnknownNameError(KeyError):
    """A model / GPU / tier name that no spec file defines; ``known`` lists the valid names."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, known
        super().__init__(f"unknown {kind} {name!r}; known {kind}s: {', '.join(known)}")

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return self.args[0]


def _read_yaml(path: Path) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read YAML: {exc}") from exc


def format_validation_error(path: Path | str, exc: ValidationError, prefix: str = "") -> str:
    """One line per problem: file, dotted key path, message (unknown keys say 'unknown key')."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        msg = "unknown key (not allowed here)" if err["type"] == "extra_forbidden" else err["msg"]
        if err["type"] == "value_error":  # a validator's own message, without pydantic's "Value error, "
            msg = str(err.get("ctx", {}).get("error", msg))
        lines.append(f"{path}: {loc}: {msg}")
    return "\n".join(lines)


def parse_model(cls: type[T], data: object, path: Path | str, prefix: str = "") -> T:
    """Validate ``data`` as ``cls``; raise ConfigError naming ``path`` and the key on failure."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc, prefix)) from None


def load_named(cls: type[T], path: Path) -> dict[str, T]:
    """A YAML mapping ``name -> fields`` into ``{name: cls(name=name, **fields)}``."""
    raw = _read_yaml(path)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping of name -> spec, got {type(raw).__name__}")
    out: dict[str, T] = {}
    for name, fields in raw.items():
        if not isinstance(fields, Mapping):
            raise ConfigError(f"{path}: {name}: expected a mapping of fields")
        out[str(name)] = parse_model(cls, {"name": str(name), **fields}, path, prefix=str(name))
    return out


def load_models(path: Path | None = None) -> dict[str, ModelSpec]:
    return load_named(ModelSpec, path or SPECS_DIR / "models.yaml")


def load_gpus(path: Path | None = None) -> dict[str, GpuProfile]:
    return load_named(GpuProfile, path or SPECS_DIR / "gpus.yaml")


def load_tiers(path: Path | None = None) -> dict[str, TierSpec]:
    return load_named(TierSpec, path or SPECS_DIR / "tiers.yaml")


def gpu_for_device(gpus: Mapping[str, GpuProfile], device: str) -> GpuProfile | None:
    """The profile whose ``device_names`` lists ``device`` (a replica's ``torch.cuda.get_device_name``, or
    ``cpu``), None when none does."""
    return next((g for g in gpus.values() if device in g.device_names), None)


def pick(kind: str, table: Mapping[str, T], name: str) -> T:
    """``table[name]`` or UnknownNameError listing the known names."""
    try:
        return table[name]
    except KeyError:
        raise UnknownNameError(kind, name, sorted(table)) from None
