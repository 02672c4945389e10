"""Command-line flags generated from the run config's typed sections: one source per setting.

A flag is a config key: ``--max-running`` is ``worker.max_running``, with the field's description
and default as its help. A nested model adds its field name as a prefix (``--engine-seed`` is
``worker.engine.seed``); a config chosen by ``kind`` (an engine, a trainer backend) gets the bare
name for its kind (``--engine vllm``) and prefixed flags for every kind's options, each saying
which kind takes it. A field may name its own flag (``json_schema_extra={"flag": ...}``) and
the sibling keys its flag replaces (``{"replaces": [...]}``). List and tuple values are shell
words (``--tags "rollout gpu"``; tags also take commas: ``--tags train,rollout,gpu=h200``).
Flags override the config file through ``seamlessflow.config.override``, so both are validated
by the same models, and an error names the flag.
"""

import argparse
import shlex
import typing
from dataclasses import dataclass, replace
from types import UnionType
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from seamlessflow.config import RunConfig, override
from seamlessflow.exceptions import ConfigError


@dataclass(frozen=True)
class Flag:
    """One generated flag: ``option`` sets the config key at ``path``."""

    option: str
    path: tuple[str, ...]
    help: str
    choices: tuple[str, ...] | None = None
    words: bool = False
    """The value is shell words (a list or tuple field)."""
    replaces: tuple[str, ...] = ()
    """Sibling keys the flag unsets when given (``--agent`` replaces a file's ``command``)."""

    @property
    def dest(self) -> str:
        return "cfg:" + ".".join(self.path)


def section_flags(
    section: str, *, only: tuple[str, ...] | None = None, skip: tuple[str, ...] = ()
) -> list[Flag]:
    """The flags of the run config section ``section`` (its fields ``only``, if given, less
    ``skip``)."""
    model = _models(RunConfig.model_fields[section].annotation)[0]
    return _model_flags(model, (section,), "", RunConfig().model_dump(), only=only, skip=skip)


def add_flags(parser: argparse.ArgumentParser, flags: list[Flag]) -> None:
    """Add ``flags`` to ``parser``; a flag not given leaves the config's value (None)."""
    group = parser.add_argument_group("settings (each overrides its key of the --config file)")
    for flag in flags:
        group.add_argument(
            flag.option,
            dest=flag.dest,
            choices=flag.choices,
            metavar="WORDS" if flag.words else None if flag.choices else "VALUE",
            help=f"{flag.help} [{'.'.join(flag.path)}]".replace("%", "%%"),
        )


def apply_flags(config: RunConfig, args: argparse.Namespace, flags: list[Flag]) -> RunConfig:
    """``config`` with the flags given in ``args`` applied; ``ConfigError`` naming the flag (or
    the config key) when the result is invalid."""
    changes: dict[str, Any] = {}
    given: dict[tuple[str, ...], str] = {}
    for flag in flags:
        value = getattr(args, flag.dest)
        if value is None:
            continue
        node = changes
        for key in flag.path[:-1]:
            node = node.setdefault(key, {})
        node[flag.path[-1]] = shlex.split(value) if flag.words else value
        node.update(dict.fromkeys(flag.replaces))
        given[flag.path] = f"{flag.option} {value!r}"
    if not given:
        return config
    try:
        return override(config, changes)
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(error, given) for error in exc.errors())) from exc


def _describe(error: Any, given: dict[tuple[str, ...], str]) -> str:
    loc = tuple(str(part) for part in error["loc"])
    for path, flag in given.items():
        # Under a kind-chosen config the kind is part of the location: worker.engine.vllm.seed.
        if loc == path or (loc[: len(path) - 1] == path[:-1] and loc[-1:] == path[-1:]):
            return f"{flag}: {error['msg']}"
    return f"{'.'.join(loc) or 'config'}: {error['msg']}"


def _model_flags(
    model: type[BaseModel],
    path: tuple[str, ...],
    prefix: str,
    defaults: dict[str, Any],
    *,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
) -> list[Flag]:
    section = defaults
    for key in path:
        section = section.get(key, {}) if isinstance(section, dict) else {}
    flags: list[Flag] = []
    for name, field in model.model_fields.items():
        if (only is not None and name not in only) or name in skip:
            continue
        option = _option(field, prefix + name)
        nested = _models(field.annotation)
        if field.discriminator and nested:
            flags += _kind_flags(field, nested, (*path, name), option, f"{prefix}{name}_", defaults)
        elif nested:
            flags += _model_flags(nested[0], (*path, name), f"{prefix}{name}_", defaults)
        else:
            default = section.get(name, field.default) if isinstance(section, dict) else None
            flags.append(
                Flag(
                    option,
                    (*path, name),
                    _help(field.description, default),
                    _choices(field.annotation),
                    words=typing.get_origin(_strip_none(field.annotation)) in (list, tuple),
                    replaces=tuple(_extra(field).get("replaces", ())),
                )
            )
    return flags


def _kind_flags(
    field: FieldInfo,
    variants: list[type[BaseModel]],
    path: tuple[str, ...],
    option: str,
    prefix: str,
    defaults: dict[str, Any],
) -> list[Flag]:
    """``--<name> KIND`` and the options of every kind, each saying which kinds take it."""
    kind = str(field.discriminator)
    kinds = tuple(str(v.model_fields[kind].default) for v in variants)
    default = defaults
    for key in (*path, kind):
        default = default.get(key) if isinstance(default, dict) else None
    flags = [Flag(option, (*path, kind), _help(field.description, default), kinds)]
    options: dict[str, tuple[Flag, list[str]]] = {}
    for variant, name in zip(variants, kinds, strict=True):
        for flag in _model_flags(variant, path, prefix, defaults, skip=(kind,)):
            options.setdefault(flag.option, (flag, []))[1].append(name)
    for flag, having in options.values():
        only = "" if len(having) == len(kinds) else f" [{'/'.join(having)} only]"
        flags.append(replace(flag, help=flag.help + only))
    return flags


def _help(description: str | None, default: Any) -> str:
    text = description or ""
    if default is not None and default != [] and "default" not in text:
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else default
        text += f" (default: {shown})"
    return text


def _option(field: FieldInfo, name: str) -> str:
    return "--" + str(_extra(field).get("flag", name.replace("_", "-")))


def _extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models ``annotation`` is, or is a union of; [] for anything else."""
    args = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    return [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]


def _is_union(annotation: Any) -> bool:
    return isinstance(annotation, UnionType) or typing.get_origin(annotation) is typing.Union


def _strip_none(annotation: Any) -> Any:
    if _is_union(annotation):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _choices(annotation: Any) -> tuple[str, ...] | None:
    annotation = _strip_none(annotation)
    if typing.get_origin(annotation) is Literal:
        return tuple(str(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, str) and annotation is not str:
        return tuple(str(member) for member in annotation)  # a StrEnum
    return None
