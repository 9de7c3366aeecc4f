"""Command-line flags generated from settings dataclasses: a field's default and help are written
once, on the field.

Each field becomes `--field-name` (a trailing `_s` dropped: `hold_s` is `--hold`) unless its
metadata names the flag, with an environment twin `AGENT_MONITOR_FIELD_NAME` (or metadata
`env`). Nested dataclass fields (the policy, run limits, metrics settings) become argument
groups. Booleans are switches; `X | None` fields accept an empty environment value as None;
tuples of strings are repeatable flags (metadata `split`: how the environment twin separates
them) or one comma-separated value (metadata `comma`). `--help` shows every default.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args, get_origin

_ENV = "AGENT_MONITOR_"
_SEP = "__"
D = TypeVar("D")


class FlagError(ValueError):
    """An environment variable (or a settings file's key) whose value the flag cannot take."""


CONFIG_ENV = _ENV + "CONFIG"
"""The environment twin of `--config FILE`."""
_SECRET_WORDS = ("token", "key", "password", "secret", "auth")


class Settings(Mapping[str, str]):
    """Where flags take their defaults from: the environment, then a settings file (`--config
    monitor.toml`).

    A Mapping of the environment (what `add_flags` always read) that also carries the file's values,
    keyed as the file writes them: a flag's long name without its dashes, `-` as `_`
    (`metrics_port = 9464` for `--metrics-port`), at the top level or in a `[serve]` table. Every
    `add_flags` call registers the keys it knows; `check()` then refuses a key no flag has, naming
    the nearest known one. Precedence: a flag given > its environment twin > the file > the default.
    """

    def __init__(
        self, environ: Mapping[str, str], file: Mapping[str, Any] | None = None, path: str = ""
    ) -> None:
        self.environ = environ
        self.file: dict[str, Any] = dict(file or {})
        self.path = path
        self.known: dict[str, str] = {}
        """Each file key a flag reads, to its flag."""

    @classmethod
    def load(cls, environ: Mapping[str, str], path: str | None) -> Settings:
        """The environment with the settings file at `path` (None: no file); FlagError for a file
        it cannot read."""
        if not path:
            return cls(environ)
        import tomllib

        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise FlagError(
                f"--config {path}: {e.strerror or e}; pass the path of a TOML settings file"
            ) from None
        except tomllib.TOMLDecodeError as e:
            raise FlagError(f"--config {path}: not TOML: {e}") from None
        flat: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, dict):
                if key != "serve":
                    raise FlagError(
                        f"--config {path}: unknown table [{key}]; settings go at the top "
                        "level or in [serve]"
                    )
                for k, v in value.items():
                    if k in flat:
                        raise FlagError(
                            f"--config {path}: {k} is set twice (at the top level and in [serve])"
                        )
                    flat[k] = v
            elif key in flat:
                raise FlagError(
                    f"--config {path}: {key} is set twice (at the top level and in [serve])"
                )
            else:
                flat[key] = value
        return cls(environ, flat, path)

    def __getitem__(self, key: str) -> str:
        return self.environ[key]

    def __iter__(self) -> typing.Iterator[str]:
        return iter(self.environ)

    def __len__(self) -> int:
        return len(self.environ)

    def value(self, leaf: _Leaf) -> tuple[Any, str]:
        """A leaf's value before the command line, and where it came from: env, file or default."""
        key = file_key(leaf.flag)
        self.known.setdefault(key, leaf.flag)
        raw = self.environ.get(leaf.env)
        if raw is not None:
            return _parse(leaf, raw), "env"
        if key in self.file:
            return _from_file(leaf, self.file[key], f"{self.path}: {key}"), "file"
        return leaf.default, "default"

    def check(self) -> None:
        """Refuse a file key no flag reads, naming the nearest known key."""
        import difflib

        for key in self.file:
            if key not in self.known:
                near = difflib.get_close_matches(key, list(self.known), n=1)
                hint = (
                    f"; did you mean {near[0]}?"
                    if near
                    else ("; keys are serve's long flags with - as _")
                )
                raise FlagError(f"--config {self.path}: unknown key {key!r}{hint}")


def file_key(flag: str) -> str:
    """A flag's key in a settings file: `--metrics-port` is `metrics_port`."""
    return flag.removeprefix("--").replace("-", "_")


def secret(flag: str) -> bool:
    """Whether a flag holds a secret (its value is masked when settings are printed)."""
    return any(w in flag for w in _SECRET_WORDS) and not flag.endswith(("-tokens", "-keys"))


def _from_file(leaf: _Leaf, value: Any, where: str) -> Any:
    """A settings file's TOML value as the leaf's flag would read it; FlagError naming the key
    for a wrong one."""
    if leaf.many:
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(i, str | int | float) and not isinstance(i, bool) for i in items):
            raise FlagError(f"{where} = {value!r}: give a string or a list of strings")
        return tuple(str(i) for i in items)
    if leaf.kind is bool:
        if not isinstance(value, bool):
            raise FlagError(f"{where} = {value!r}: give true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise FlagError(f"{where} = {value!r}: give {_what(leaf, none=leaf.optional)}")
    if isinstance(value, str) and leaf.optional and value.strip().lower() in ("", "none", "off"):
        return None
    if isinstance(value, str) and (word := _word(leaf, value)) is not None:
        return word
    if leaf.kind in (int, float) and isinstance(value, str):
        raise FlagError(
            f"{where} = {value!r}: give {_what(leaf, none=leaf.optional)} (a TOML number, unquoted)"
        )
    if leaf.kind is int and isinstance(value, float):
        raise FlagError(f"{where} = {value!r}: give an integer")
    converted = leaf.kind(value)
    if leaf.choices and converted not in leaf.choices:
        raise FlagError(f"{where} = {value!r}: use one of {', '.join(leaf.choices)}")
    return converted


@dataclasses.dataclass(frozen=True, slots=True)
class _Leaf:
    path: tuple[str, ...]
    flag: str
    env: str
    kind: type
    optional: bool
    choices: tuple[str, ...] | None
    words: tuple[str, ...]  # taken as they are by a number flag (`float | Literal["auto"]`)
    many: str | None  # "append" or "comma" for tuples of strings
    split: str
    default: Any
    help: str


def flag_name(f: dataclasses.Field[Any]) -> str:
    """The flag of a field: metadata `flag`, else `--name` with a trailing `_s` dropped."""
    name = f.metadata.get("flag")
    return str(name) if name else "--" + f.name.removesuffix("_s").replace("_", "-")


def env_name(f: dataclasses.Field[Any]) -> str:
    """The environment twin of a field's flag."""
    return _ENV + str(f.metadata.get("env") or flag_name(f)[2:].upper().replace("-", "_"))


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default; flags need one")


def _hint(cls: type, f: dataclasses.Field[Any]) -> Any:
    """A field's type as its flag reads it: metadata `flag_type` where given, else its annotation.

    Resolved field by field in the module of the class that declares it: a settings class may
    inherit fields (MonitorConfig's scoring settings are `ScoringOptions`'), and a field whose
    type no flag can take (a rubric, in Python, may be a mapping) says with `flag_type` what its
    flag takes.
    """
    if "flag_type" in f.metadata:
        return f.metadata["flag_type"]
    if not isinstance(f.type, str):
        return f.type
    owner = next(k for k in cls.__mro__ if f.name in inspect.get_annotations(k))
    # The annotation is our own source text (from __future__ annotations), not input: evaluating it
    # is safe.
    return eval(f.type, vars(sys.modules[owner.__module__]))


def _leaves(cls: type, default: Any, path: tuple[str, ...]) -> list[tuple[str | None, list[_Leaf]]]:
    """(group title, leaves) for `cls`: its own scalar fields first, then one group per nested
    dataclass."""
    own: list[_Leaf] = []
    groups: list[tuple[str | None, list[_Leaf]]] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        value = getattr(default, f.name)
        hint = _hint(cls, f)
        if dataclasses.is_dataclass(hint):
            for _, leaves in _leaves(hint, value, (*path, f.name)):  # type: ignore[arg-type]
                groups.append((f.metadata.get("help") or f.name, leaves))
            continue
        own.append(_leaf(f, hint, value, (*path, f.name)))
    return [(None, own), *groups]


def _leaf(f: dataclasses.Field[Any], hint: Any, default: Any, path: tuple[str, ...]) -> _Leaf:
    optional = False
    words: tuple[str, ...] = ()
    if get_origin(hint) in (typing.Union, types.UnionType):
        args = get_args(hint)
        optional = type(None) in args
        literals = [a for a in args if get_origin(a) is Literal]
        rest = [a for a in args if a is not type(None) and get_origin(a) is not Literal]
        if literals and len(rest) == 1:
            words = tuple(str(v) for a in literals for v in get_args(a))
            (hint,) = rest
        elif len(rest) + len(literals) == 1:
            (hint,) = rest or literals
        else:
            raise TypeError(f"field {f.name}: no flag for type {hint!r}; mark it cli=False")
    choices = None
    many = None
    if get_origin(hint) is Literal:
        choices = tuple(str(a) for a in get_args(hint))
        kind: type = str
    elif get_origin(hint) is tuple:
        kind, many = str, "comma" if f.metadata.get("comma") else "append"
    elif hint in (bool, int, float, str):
        kind = hint
    else:
        raise TypeError(f"field {f.name}: no flag for type {hint!r}; mark it cli=False")
    return _Leaf(
        path=path,
        flag=flag_name(f),
        env=env_name(f),
        kind=kind,
        optional=optional,
        choices=choices,
        words=words,
        many=many,
        split=str(f.metadata.get("split", os.pathsep if "dir" in f.name else ",")),
        default=default,
        help=str(f.metadata.get("help", "")),
    )


def _parse(leaf: _Leaf, raw: str) -> Any:
    if leaf.many:
        return tuple(
            p.strip() for p in raw.split(leaf.split if leaf.many == "append" else ",") if p.strip()
        )
    if leaf.kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("", "0", "false", "no", "off"):
            return False
        raise FlagError(f"{leaf.env}={raw!r} is not a boolean; use 1 or 0")
    if raw.strip() == "" and leaf.optional:
        return None
    if (word := _word(leaf, raw)) is not None:
        return word
    try:
        value = leaf.kind(raw)
    except ValueError:
        raise FlagError(f"{leaf.env}={raw!r} is not {_what(leaf)}") from None
    if leaf.choices and value not in leaf.choices:
        raise FlagError(f"{leaf.env}={raw!r}: use one of {', '.join(leaf.choices)}")
    return value


def _word(leaf: _Leaf, raw: str) -> str | None:
    """The word `raw` spells (case and spaces aside), if the leaf takes words; else None."""
    low = raw.strip().lower()
    return next((w for w in leaf.words if w.lower() == low), None)


def _what(leaf: _Leaf, *, none: bool = False) -> str:
    """What a leaf's value must be, for error messages ("a number, auto or none")."""
    items = [
        {int: "an integer", float: "a number"}.get(leaf.kind, "a value"),
        *leaf.words,
        *(["none"] if none else []),
    ]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "none" if value is None else str(value)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with each hand-written option's default shown as a generated flag shows its
    own.

    Generated flags carry `(default: X)` in their help already; switches are off unless given; an
    option whose default is None says in its own help what that means.
    """

    def add_argument(self, action: argparse.Action) -> None:
        """Measure subcommands at the indent they are printed at (argparse leaves it out: long
        names wrap)."""
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction) and action.help is not argparse.SUPPRESS:
            for sub in action._get_subactions():
                width = (
                    len(self._format_action_invocation(sub))
                    + self._current_indent
                    + self._indent_increment
                )
                self._action_max_length = max(self._action_max_length, width)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "(default:" in text
            or not action.option_strings
            or action.default is None
            or action.default is argparse.SUPPRESS
            or action.nargs == 0  # switches, --help, --version
        ):
            return text
        return f"{text} (default: {_shown(action.default).replace('%', '%%')})"


def _metavar(leaf: _Leaf) -> str | None:
    if leaf.choices or leaf.kind is bool:
        return None
    if leaf.many:
        return (
            "A,B"
            if leaf.many == "comma"
            else leaf.path[-1].removesuffix("s").split("_")[-1].upper()
        )
    if leaf.path[-1].endswith("_s") or leaf.path[-1].endswith("timeout"):
        return "SECONDS"
    base = {int: "N", float: "X"}.get(leaf.kind) or leaf.flag[2:].split("-")[-1].upper()
    return "|".join([base, *leaf.words])


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    environ: Mapping[str, str],
    *,
    default: Any = None,
    only: Sequence[str] | None = None,
    title: str | None = None,
) -> None:
    """Add a flag for each field of `cls` (nested ones in groups), defaults from `default` or the
    environment.

    `only` keeps the fields with those names (nested paths as `policy.min_steps`).
    """
    base = default if default is not None else cls()
    for group_title, leaves in _leaves(cls, base, ()):
        chosen = [
            lf for lf in leaves if only is None or ".".join(lf.path) in only or lf.path[-1] in only
        ]
        if not chosen:
            continue
        target: Any = parser
        if group_title is not None or title is not None:
            target = parser.add_argument_group(group_title or title)
        for lf in chosen:
            if isinstance(environ, Settings):
                value, origin = environ.value(lf)
            else:
                raw = environ.get(lf.env)
                value, origin = (lf.default, "default") if raw is None else (_parse(lf, raw), "env")
            parser.set_defaults(**{_SEP.join(lf.path) + _SEP + "origin": origin})
            dest = _SEP.join(lf.path)
            text = f"{lf.help} (default: {_shown(lf.default)}) [{lf.env}]".lstrip()
            if lf.kind is bool:
                target.add_argument(
                    lf.flag, dest=dest, action="store_true", default=value, help=text
                )
            elif lf.many == "append":
                target.add_argument(
                    lf.flag,
                    dest=dest,
                    action="append",
                    default=None,
                    help=text,
                    metavar=_metavar(lf),
                )
                parser.set_defaults(**{dest + _SEP + "env": value})
            elif lf.many == "comma":
                target.add_argument(
                    lf.flag,
                    dest=dest,
                    type=functools.partial(_parse, lf),
                    default=value,
                    help=text,
                    metavar="A,B",
                )
            else:
                parser.set_defaults(**{dest + _SEP + "given": origin != "default"})
                target.add_argument(
                    lf.flag,
                    dest=dest,
                    action=_Given,
                    type=_typed(lf),
                    default=value,
                    choices=lf.choices,
                    help=text,
                    metavar=_metavar(lf),
                )


class _Given(argparse.Action):
    """Store the value and note that the flag was given (its value may equal the default:
    `--abort-below none`)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + _SEP + "given", True)


def given(args: argparse.Namespace, group: str) -> tuple[str, ...]:
    """The fields of a nested settings group (e.g.

    "policy") whose flag or environment twin was given.
    """
    head, tail = group + _SEP, _SEP + "given"
    return tuple(
        sorted(
            k[len(head) : -len(tail)]
            for k, v in vars(args).items()
            if v is True and k.startswith(head) and k.endswith(tail)
        )
    )


def _typed(leaf: _Leaf) -> Any:
    def convert(raw: str) -> Any:
        if leaf.optional and raw.strip().lower() in ("", "none", "off"):
            return None
        if (word := _word(leaf, raw)) is not None:
            return word
        try:
            return leaf.kind(raw)
        except ValueError:
            if not leaf.words:
                raise  # argparse's own "invalid float value: 'x'"
            raise argparse.ArgumentTypeError(
                f"{raw!r} is not {_what(leaf, none=leaf.optional)}"
            ) from None

    # argparse names the type in its "invalid ... value" message
    convert.__name__ = leaf.kind.__name__
    return convert


def build(cls: type[D], args: argparse.Namespace, *, default: D | None = None, **fixed: Any) -> D:
    """The `cls` the parsed flags describe: flags given, else environment, else the field's default.

    Fields not on the command line (metadata `cli=False`, or left out by `only`) keep `default`'s
    values; `fixed` sets top-level fields directly (e.g. `broker=` built from the URL flags).
    """
    base = default if default is not None else cls()
    return _build(cls, base, args, (), fixed)  # type: ignore[no-any-return]


def _build(
    cls: type, base: Any, args: argparse.Namespace, path: tuple[str, ...], fixed: dict[str, Any]
) -> Any:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not path and f.name in fixed:
            values[f.name] = fixed[f.name]
            continue
        if f.metadata.get("cli") is False:
            continue
        hint = _hint(cls, f)
        current = getattr(base, f.name)
        if dataclasses.is_dataclass(hint):
            values[f.name] = _build(hint, current, args, (*path, f.name), {})  # type: ignore[arg-type]
            continue
        dest = _SEP.join((*path, f.name))
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        # a repeatable flag not given: the environment's
        if value is None and hasattr(args, dest + _SEP + "env"):
            value = getattr(args, dest + _SEP + "env")
        elif isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return dataclasses.replace(base, **values)


def leaves(cls: type, default: Any = None) -> list[_Leaf]:
    """Every flag `cls` makes (nested settings included), for printing the effective settings."""
    return [
        lf
        for _, group in _leaves(cls, default if default is not None else cls(), ())
        for lf in group
    ]


def origin(args: argparse.Namespace, leaf: _Leaf, argv: Sequence[str]) -> str:
    """Where a flag's value came from: flag (on the command line), env, file or default."""
    if any(a == leaf.flag or a.startswith(leaf.flag + "=") for a in argv):
        return "flag"
    return str(getattr(args, _SEP.join(leaf.path) + _SEP + "origin", "default"))


def value_of(args: argparse.Namespace, leaf: _Leaf) -> Any:
    """A flag's parsed value in `args` (a repeatable flag not given: its environment's or
    file's)."""
    dest = _SEP.join(leaf.path)
    value = getattr(args, dest, leaf.default)
    if value is None and hasattr(args, dest + _SEP + "env"):
        value = getattr(args, dest + _SEP + "env")
    return tuple(value) if isinstance(value, list) else value


__all__ = [
    "CONFIG_ENV",
    "FlagError",
    "HelpFormatter",
    "Settings",
    "add_flags",
    "build",
    "env_name",
    "file_key",
    "flag_name",
    "given",
    "leaves",
    "origin",
    "secret",
    "value_of",
]
