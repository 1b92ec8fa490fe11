"""Settings as data: a config's fields carry their flags, and argparse is built from them.

A frozen dataclass declares each setting once. A field becomes a command-line
flag when its ``metadata`` holds a ``help`` (plain data, so that a pure core
needs no import to declare one); :func:`setting` writes such a field::

    max_prefill_tokens: int = field(
        default=16384, metadata={"help": "most tokens one prefill batch computes"}
    )
    reap_interval: float = setting(0.25, "seconds between checks for expired leases")

Metadata keys (all optional but ``help``):

``flag``      the option name (default: ``--`` and the field name with dashes)
``group``     the argparse group's title (default: the enclosing part's, else none)
``metavar``   as argparse's
``choices``   the allowed values (default: an enum type's values)
``type``      what parses the text (default: the field's type: int, float, str; a
              ``bool`` field is a switch, ``store_true``)
``scale``     the flag's unit in the field's (``1e9``: the flag takes GB, the field
              holds bytes)
``env``       an environment variable whose value, if set, is the flag's default
``default``   the flag's default, where it is not the field's (in the field's units)
``forward``   ``kvstack serve`` and ``kvstack up`` take this flag and pass it on
              when the user sets it (:mod:`kvstack.stack.forward`)

A field whose metadata has ``part`` (a config class) holds that class, built
from its own flagged fields: ``group`` names the group of its flags,
``fields`` gives metadata by field name, over (or instead of) the class's own
(flags for a class declared elsewhere, or other defaults); ``switch``
(a flag name, with ``help``) makes the part optional: None unless the switch is
given; ``partial`` keeps only the flagged values, as a read-only mapping, for a
class that needs more than flags to be built (the scheduler's, which needs
memsvc's page size).

:func:`add_arguments` adds the flags; :func:`from_args` builds the config;
:func:`to_argv` turns a set of values (by argparse ``dest``) back into the
flags that give them. :func:`add_config_argument` and :func:`parse_args` add
``--config FILE``: a YAML mapping whose keys are flag names (dashes or
underscores, no leading ``--``); the command line wins over it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METADATA_KEYS = {
    "help", "flag", "group", "metavar", "choices", "type", "scale", "env", "forward", "default"
}  # fmt: skip
PART_KEYS = {"part", "group", "fields", "switch", "help", "partial", "forward"}


def setting(default: Any = dataclasses.MISSING, help: str = "", **metadata: Any) -> Any:
    """A dataclass field that is a flag: ``help`` and the metadata keys above.

    No ``default``: a required flag.
    """
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


class SettingsError(ValueError):
    """A config class declares a flag wrongly (a bug, found when its parser is built)."""


@dataclass(frozen=True)
class Flag:
    """One flag of a config class.

    Its values on the command line and in an argparse namespace are in the flag's
    units and plain (``str`` for an enum); :meth:`field_value` turns one into the
    field's.
    """

    name: str
    help: str
    default: Any  # argparse's: in the flag's units
    required: bool = False
    switch: bool = False  # store_true
    kind: Callable[[str], Any] | None = None  # argparse's type (None: the text)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    group: str | None = None
    scale: float | None = None
    enum: type[enum.Enum] | None = None
    forward: bool = False

    @property
    def dest(self) -> str:
        return _dest(self.name)

    def field_value(self, value: Any) -> Any:
        """A namespace value in the field's type: an enum member, bytes for a GB flag."""
        if value is None:
            return None
        if self.enum is not None:
            return self.enum(value)
        if self.scale is not None:
            return int(value * self.scale)
        return value

    def text(self, value: Any) -> str:
        """``value`` (a namespace value) as the command line writes it."""
        return str(value.value if isinstance(value, enum.Enum) else value)

    def add_to(self, group: Any, *, default: Any = None, help: str | None = None) -> None:
        """The argparse argument; ``default``: argparse's if not ours (e.g. ``SUPPRESS``)."""
        default = self.default if default is None else default
        help = self.help if help is None else help
        if self.switch:
            group.add_argument(self.name, action="store_true", default=default, help=help)
            return
        group.add_argument(
            self.name,
            type=self.kind,
            choices=self.choices,
            default=default,
            required=self.required,
            metavar=self.metavar,
            help=help,
        )


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


# -- reading a config class -------------------------------------------------------------------


def flags(
    cls: type,
    *,
    group: str | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Flag]:
    """Every flag of ``cls`` and of its parts, in field order.

    ``overrides``: metadata by field name, over the fields' own (a part's ``fields``).
    """
    out: list[Flag] = []
    hints = typing.get_type_hints(cls)
    for f, meta in _fields(cls, overrides):
        if "part" in meta:
            part_group = meta.get("group", group)
            if "switch" in meta:
                forward = meta.get("forward", False)
                switch = Flag(meta["switch"], meta["help"], False, switch=True)
                out.append(dataclasses.replace(switch, group=part_group, forward=forward))
            out += flags(meta["part"], group=part_group, overrides=meta.get("fields"))
        elif "help" in meta:
            out.append(_flag(f, meta, hints[f.name], group))
    return out


def _fields(
    cls: type, overrides: Mapping[str, Mapping[str, Any]] | None
) -> Iterator[tuple[dataclasses.Field, Mapping[str, Any]]]:
    """Each field of ``cls`` with its metadata (``overrides`` win), checked."""
    overrides = overrides or {}
    for f in dataclasses.fields(cls):
        meta = {**f.metadata, **overrides.get(f.name, {})}
        known = PART_KEYS if "part" in meta else METADATA_KEYS
        unknown = set(meta) - known
        if unknown:
            raise SettingsError(f"{cls.__name__}.{f.name}: unknown flag metadata {sorted(unknown)}")
        yield f, meta


def _flag(f: dataclasses.Field, meta: Mapping[str, Any], hint: Any, group: Any) -> Flag:
    kind = _unwrap_optional(hint)
    enum_type = kind if isinstance(kind, type) and issubclass(kind, enum.Enum) else None
    if "default" in meta:
        required, default = False, meta["default"]
    elif f.default is not dataclasses.MISSING:
        required, default = False, f.default
    elif f.default_factory is not dataclasses.MISSING:
        required, default = False, f.default_factory()
    else:
        required, default = True, None
    scale = meta.get("scale")
    if scale is not None and default is not None:
        default = type(default)(default / scale)  # 0 bytes shows as 0 GB
    parse = meta.get("type", None if kind is str or enum_type else kind)
    if "env" in meta and os.environ.get(meta["env"]) not in (None, ""):
        default = (parse or str)(os.environ[meta["env"]])
    if isinstance(default, enum.Enum):
        default = default.value
    choices = meta.get("choices")
    if choices is None and enum_type is not None:
        choices = tuple(m.value for m in enum_type)
    return Flag(
        meta.get("flag", "--" + f.name.replace("_", "-")),
        meta["help"],
        default,
        required=required,
        switch=kind is bool,
        kind=parse,
        choices=tuple(choices) if choices is not None else None,
        metavar=meta.get("metavar"),
        group=meta.get("group", group),
        scale=scale,
        enum=enum_type,
        forward=meta.get("forward", False),
    )


def _unwrap_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


# -- argparse ---------------------------------------------------------------------------------


def add_arguments(
    parser: argparse.ArgumentParser, cls: type, *, groups: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Add the flags of ``cls`` to ``parser``, each in its group; returns the groups by title.

    ``groups``: groups made before (by title), to add to rather than make again.
    """
    groups = {} if groups is None else groups
    for flag in flags(cls):
        flag.add_to(group_of(parser, groups, flag.group))
    return groups


def group_of(parser: argparse.ArgumentParser, groups: dict[str, Any], title: str | None) -> Any:
    """The group ``title`` of ``parser`` (made once, kept in ``groups``); None: the parser."""
    if title is None:
        return parser
    if title not in groups:
        groups[title] = parser.add_argument_group(title)
    return groups[title]


def from_args(cls: type, args: argparse.Namespace | Mapping[str, Any]) -> Any:
    """``cls`` built from parsed flags (by argparse ``dest``; one absent keeps the field's
    default)."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    return cls(**_kwargs(cls, values))


def _kwargs(
    cls: type,
    values: Mapping[str, Any],
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The fields of ``cls`` that ``values`` give, through its flags and its parts'."""
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f, meta in _fields(cls, overrides):
        if "part" in meta:
            part = meta["part"]
            given = _kwargs(part, values, overrides=meta.get("fields"))
            if "switch" in meta and not values.get(_dest(meta["switch"])):
                kwargs[f.name] = None
            else:
                kwargs[f.name] = (
                    types.MappingProxyType(given) if meta.get("partial") else part(**given)
                )
        elif "help" in meta:
            flag = _flag(f, meta, hints[f.name], None)
            if flag.dest in values:
                kwargs[f.name] = flag.field_value(values[flag.dest])
            elif "default" in meta:
                kwargs[f.name] = meta["default"]
    return kwargs


def to_argv(cls: type, values: Mapping[str, Any]) -> list[str]:
    """The flags of ``cls`` that give ``values`` (by ``dest``, as a namespace holds them), in
    declaration order; a switch that is off and a value of None give nothing."""
    argv: list[str] = []
    for flag in flags(cls):
        if flag.dest not in values:
            continue
        value = values[flag.dest]
        if flag.switch:
            argv += [flag.name] if value else []
        elif value is not None:
            argv += [flag.name, flag.text(value)]
    return argv


# -- --config FILE ----------------------------------------------------------------------------

CONFIG_HELP = (
    "YAML file of flag values, keyed by flag name without the dashes in front (dashes or "
    "underscores inside); flags on the command line win"
)


def add_config_argument(parser: Any) -> None:
    """``--config FILE``, which :func:`parse_args` (or :func:`apply_config_file`) reads."""
    parser.add_argument("--config", default=None, metavar="FILE", help=CONFIG_HELP)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``--config FILE``'s values as the defaults."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    apply_config_file(parser, argv)
    return parser.parse_args(argv)


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """If ``argv`` has ``--config FILE``, make FILE's values ``parser``'s defaults.

    An unknown key, a value of the wrong type or outside the flag's choices, or
    a file that is not a YAML mapping is an error in ``parser``'s usage (exit 2).
    A key set to null leaves the flag's default.
    """
    if "--config" not in parser._option_string_actions:
        return
    # Only --config and the mutually exclusive flags, abbreviations too (as argparse
    # takes ``--conf FILE``); the rest of argv is left for the real parse.
    finder = argparse.ArgumentParser(prog=parser.prog, add_help=False)
    finder.add_argument("--config", default=None)
    exclusive = [g._group_actions for g in parser._mutually_exclusive_groups]
    for action in (a for group in exclusive for a in group):
        finder.add_argument(
            *action.option_strings,
            dest=action.dest,
            nargs=action.nargs,
            default=None,
            action="store_const" if action.nargs == 0 else "store",
            **({"const": True} if action.nargs == 0 else {}),
        )
    found = finder.parse_known_args(list(argv))[0]
    path = found.config
    if path is None:
        return
    try:
        values = config_file_values(parser, path)
        _one_of_each_group(values, exclusive, given=vars(found))
    except (OSError, ValueError) as exc:
        parser.error(f"--config {path}: {exc}")
    for action in parser._actions:
        if action.dest in values:
            action.required = False
    parser.set_defaults(**values)


def _one_of_each_group(
    values: dict[str, Any], groups: list[list[argparse.Action]], given: Mapping[str, Any]
) -> None:
    """Check the file against ``parser``'s mutually exclusive groups, in ``values``.

    Two keys of one group in the file are an error, as the two flags are on the
    command line; a key whose group has another flag on the command line is
    dropped (the command line wins).
    """
    for group in groups:
        in_file = [a for a in group if a.dest in values]
        if len(in_file) > 1:
            names = " and ".join(a.option_strings[-1].lstrip("-") for a in in_file)
            raise ValueError(f"keys {names} cannot both be set (one of them only)")
        if in_file and any(given.get(a.dest) is not None for a in group if a not in in_file):
            del values[in_file[0].dest]


def config_file_values(parser: argparse.ArgumentParser, path: str | Path) -> dict[str, Any]:
    """The values of the YAML file ``path`` by argparse ``dest``, each checked as its flag's."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("must be a mapping of flag names to values")
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = "--" + str(key).replace("_", "-")
        action = parser._option_string_actions.get(name)
        if action is None or action.dest in ("help", "config") or str(key).startswith("-"):
            raise ValueError(f"unknown key {key!r} (there is no {name} flag)")
        if value is None:
            continue
        try:
            converted = _config_value(action, value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"key {key!r}: {exc}") from None
        if converted is not _UNSET:
            values[action.dest] = converted
    return values


_UNSET = object()


def _config_value(action: argparse.Action, value: Any) -> Any:
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return action.const if value else _UNSET
    if isinstance(action, argparse._AppendAction) or action.nargs not in (None, "?"):
        items = value if isinstance(value, list) else [value]
        return [_config_scalar(action, item) for item in items]
    return _config_scalar(action, value)


def _config_scalar(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, dict | list | bool):
        raise ValueError(f"expected one {_type_name(action)} value, got {value!r}")
    text = str(value)
    if action.type is not None:
        try:
            parsed = action.type(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise ValueError(f"invalid {_type_name(action)} value: {value!r}") from None
    else:
        parsed = text
    if action.choices is not None and parsed not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"invalid choice: {value!r} (choose from {choices})")
    return parsed


def _type_name(action: argparse.Action) -> str:
    return getattr(action.type, "__name__", "str") if action.type else "str"
