"""Command-line flags made from a config dataclass's fields, so adding a field adds its
flag: ``--field-name``, typed from the annotation, help text, group and choices from the
field's metadata (``help``, ``group``, ``choices``), a bool as ``--x`` / ``--no-x``.
Optional metadata: ``parse`` (the argparse type of a field that is not a scalar, such as a
comma list), ``aliases`` (more flag names), ``metavar``. ``tokenlake serve`` and
``tokenlake goodput`` make their flags this way."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

_SCALARS = (int, float, str)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _scalar_type(cls: type, annotation: object) -> type:
    """The argparse type of a field annotated ``T`` or ``T | None`` (``T`` in int, float,
    str, bool); anything else is a programming error in the config."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            annotation = args[0]
    if annotation is bool or annotation in _SCALARS:
        return annotation
    raise TypeError(f"{cls.__name__}: no flag type for annotation {annotation!r}")


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add one flag per field of ``config_cls`` (a dataclass whose every field has
    ``help`` and ``group`` metadata), each in its group, defaults from the class."""
    hints = typing.get_type_hints(config_cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(config_cls):
        meta = f.metadata
        if not meta.get("help") or not meta.get("group"):
            raise TypeError(f"{config_cls.__name__}.{f.name}: give the field help and group")
        group = groups.get(meta["group"])
        if group is None:
            group = groups[meta["group"]] = parser.add_argument_group(meta["group"])
        kind = meta.get("parse") or _scalar_type(config_cls, hints[f.name])
        names = (flag_name(f.name), *meta.get("aliases", ()))
        if kind is bool:
            group.add_argument(
                *names, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                help=meta["help"],
            )  # fmt: skip
            continue
        group.add_argument(
            *names, dest=f.name, type=kind, default=f.default, choices=meta.get("choices"),
            metavar=meta.get("metavar"), help=meta["help"],
        )  # fmt: skip


def group_of(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's argument group titled ``title`` (made if missing)."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def config_from_namespace(config_cls: type, args: argparse.Namespace):
    """``config_cls`` built from the parsed flags (one attribute per field)."""
    return config_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)})
