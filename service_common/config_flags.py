"""Command-line flags read off the config dataclasses, so a flag is written once, on its field.

A config field that is a flag carries it in its metadata:

    block_size: int = field(default=16, metadata=flag("--block-size", help="tokens per KV block"))

`add_config_flags(parser, Config)` adds one argument per such field, in field order, with the
field's default and type; `config_from_flags(Config, args)` builds the config back from the
parsed arguments, so a flag cannot drift from its field: its default is the field's, and what it
parses into goes nowhere but the field (as vLLM's `EngineArgs.add_cli_args` reads its dataclass).
A field without a flag is a setting only code sets. The parsed attribute keeps argparse's name
for the flag (`--threads` → `args.threads`), which deployment files and tests read.

Where a flag counts in other units than its field (`--kv-cache-gb` for `kv_cache_bytes`), the
flag's `unit` converts both ways; a `--no-...` flag turns a boolean field off (`negated`).
The TLS flags are defined here once: the scheduler's fields carry them, and the executor (whose
engine config has no TLS) adds them as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_FLAG = "flag"  # the metadata key


@dataclass(frozen=True)
class Unit:
    """A flag counting in other units than its field: the flag's value is the field's times `per_field_unit`."""

    name: str  # how the flag counts: "GiB", "ms"
    per_field_unit: float

    def to_flag(self, value: float | None) -> float | None:
        return None if value is None else value * self.per_field_unit

    def to_field(self, value: float | None) -> float | None:
        return None if value is None else value / self.per_field_unit


GIB = Unit("GiB", 2.0**-30)  # of a field in bytes (a power of two: exact both ways)
MS = Unit("ms", 1e3)  # of a field in seconds


@dataclass(frozen=True)
class Flag:
    name: str  # "--block-size"
    help: str | None = None
    unit: Unit | None = None
    negated: bool = False  # a `--no-...` switch: given, the (boolean) field is False
    both_ways: bool = False  # a boolean as `--x / --no-x`
    type: Callable[[str], Any] | None = None  # parses the flag's text; default: the field's type (or float with a unit)
    choices: tuple[str, ...] | None = None
    nargs: str | None = None  # "?": the flag alone means `const`
    const: Any = None
    group: str | None = None  # the title of the argument group it is listed under in --help


def flag(name: str, **kwargs: Any) -> dict[str, Flag]:
    """The metadata of a field that is the flag `name` (Flag's fields as keywords)."""
    return {_FLAG: Flag(name, **kwargs)}


def flag_fields(config_cls: type) -> Iterator[tuple[dataclasses.Field, Flag]]:
    """(field, its flag) for each field of the config class that is a flag, in field order."""
    for f in dataclasses.fields(config_cls):
        if (spec := f.metadata.get(_FLAG)) is not None:
            yield f, spec


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One argument per flag field of `config_cls`, its default the field's, in field order."""
    hints = typing.get_type_hints(config_cls)
    defaults = config_cls()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f, spec in flag_fields(config_cls):
        target = parser
        if spec.group is not None:
            if spec.group not in groups:
                groups[spec.group] = parser.add_argument_group(spec.group)
            target = groups[spec.group]
        add_flag(target, spec, getattr(defaults, f.name), hints[f.name], field_name=f.name)


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    spec: Flag,
    default: Any,
    field_type: Any,
    field_name: str | None = None,
) -> None:
    """The argument for one flag, given its field's default and type."""
    value_type = _value_type(field_type)
    kwargs: dict[str, Any] = {"help": spec.help}
    if value_type is bool:
        if spec.both_ways:
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        elif spec.negated != default:  # a switch that could only set the field to what it already is
            raise ValueError(f"{spec.name}: a switch for {field_name} (default {default}) would change nothing")
        else:
            kwargs.update(action="store_true", default=not default if spec.negated else default)
    else:
        if spec.negated or spec.both_ways:
            raise ValueError(f"{spec.name}: only a boolean field's flag is a switch")
        parse = spec.type or (float if spec.unit else value_type)
        if parse is not str:
            kwargs["type"] = parse
        kwargs["default"] = spec.unit.to_flag(default) if spec.unit else default
        for key in ("choices", "nargs", "const"):
            if getattr(spec, key) is not None:
                kwargs[key] = getattr(spec, key)
    parser.add_argument(spec.name, **kwargs)


def config_from_flags(config_cls: type, args: argparse.Namespace) -> Any:
    """The config the parsed flags say (fields that are not flags keep their defaults), validated by its class."""
    hints = typing.get_type_hints(config_cls)
    values = {}
    for f, spec in flag_fields(config_cls):
        values[f.name] = field_value(spec, getattr(args, dest(spec)), hints[f.name])
    try:
        return config_cls(**values)
    except ValueError as exc:  # the class names its fields; the person typed flags
        raise ValueError(in_flag_names(str(exc), config_cls)) from exc


def in_flag_names(message: str, config_cls: type) -> str:
    """`message` with each flag field's name replaced by its flag ("max_draft_tokens must be >= 0"
    -> "--max-draft-tokens must be >= 0")."""
    for f, spec in flag_fields(config_cls):
        message = re.sub(rf"(?<![\w-]){re.escape(f.name)}(?![\w-])", spec.name, message)
    return message


def config_or_usage_error(parser: argparse.ArgumentParser, config_cls: type, args: argparse.Namespace) -> Any:
    """config_from_flags, or argparse's usage error (exit status 2) naming the flag, before anything starts."""
    try:
        return config_from_flags(config_cls, args)
    except ValueError as exc:
        parser.error(str(exc))


def field_value(spec: Flag, value: Any, field_type: Any) -> Any:
    """What the field holds for the flag's parsed value."""
    if spec.negated:
        return not value
    if spec.unit is not None:
        value = spec.unit.to_field(value)
        if value is not None and _value_type(field_type) is int:
            value = int(value)
    return value


def dest(spec: Flag) -> str:
    """The attribute argparse stores the flag under (`--kv-cache-gb` → `kv_cache_gb`)."""
    return spec.name.removeprefix("--").replace("-", "_")


def _value_type(field_type: Any) -> Any:
    """int for `int` and `int | None`, and so on."""
    if isinstance(field_type, types.UnionType) or typing.get_origin(field_type) is typing.Union:
        (inner,) = [t for t in typing.get_args(field_type) if t is not type(None)]
        return inner
    return field_type


# ----------------------------------------------------------- flags both services take

# The metadata of a config field that is one of them: `field(default=None, metadata=TLS_CERT)`.
TLS_CERT = types.MappingProxyType(flag("--tls-cert", help="serve over TLS with this certificate (PEM; with --tls-key)"))
TLS_KEY = types.MappingProxyType(flag("--tls-key", help="the private key of --tls-cert (PEM)"))


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-cert and --tls-key, for a service whose config has no field for them."""
    for metadata in (TLS_CERT, TLS_KEY):
        add_flag(parser, metadata[_FLAG], None, str | None)
