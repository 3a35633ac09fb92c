"""The algorithm registry: every algorithm's name, the graphs it runs on, its options and its class.

Config validation, the command-line flags, the settings fingerprint and node construction all read
this registry, so adding an algorithm is one file in p2ptrain/algorithms (its options dataclass, its
class, a `register` call): every module of the package is imported once, and the ones that
register are the algorithms. Nothing else names algorithms.

Importing the registry imports no torch: algorithm modules keep torch out of their import (they do
math on the tensors they are handed), so `p2ptrain --help` stays fast.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

from p2ptrain.choices import OptimizerName

if TYPE_CHECKING:
    from p2ptrain.algorithms.base import Algorithm, Comm

@dataclass(frozen=True)
class OptionInfo:
    """How an option field shows up outside its dataclass."""

    help: str
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    fingerprint: bool = True  # every node of a cluster must agree on it (checked in Hello)


def option(default: Any, help: str, *, metavar: str | None = None, choices: tuple[Any, ...] | None = None,
           fingerprint: bool = True) -> Any:
    """A field of an algorithm's options dataclass: its default, its --flag help, whether it enters
    the settings fingerprint. The flag is --field-name; TOML/env use the field name."""
    info = OptionInfo(help, metavar, choices, fingerprint)
    return field(default=default, metadata={"option": info})


class AlgorithmOptions:
    """Base of every options dataclass (frozen). `validate` raises ValueError saying what is wrong;
    `settings` holds the common settings (a NodeConfig) for checks that involve them."""

    def bounded_delay(self) -> int:
        """Steps a message may lag behind by design (SGP's overlap τ); 0 for lock-step algorithms.
        The node's lag limit is derived from it."""
        return 0

    def validate(self, settings) -> None:
        for f in dataclasses.fields(self):
            info: OptionInfo = f.metadata["option"]
            value = getattr(self, f.name)
            if info.choices is not None and value not in info.choices:
                raise ValueError(f"unknown {f.name} {value!r}; choose from {', '.join(map(str, info.choices))}")


@dataclass(frozen=True)
class BuildContext:
    """What building an algorithm needs besides its options."""

    topology: str        # resolved graph name (AlgorithmSpec.topologies)
    seed: int = 0


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    summary: str                                   # one line, for --help and the README table
    options: type[AlgorithmOptions]                # a frozen dataclass of option() fields
    build: Callable[["Comm", Any, BuildContext], "Algorithm"] | None  # None: not run by a peer node
    topologies: tuple[str, ...] = ()               # graphs it runs on; the first is the default
    role: Literal["peer", "parameter-server"] = "peer"  # parameter-server: `ps` + `--role worker`
    default_optimizer: OptimizerName = "sgd"       # the local optimizer `p2ptrain node` builds for it

    @property
    def default_topology(self) -> str | None:
        return self.topologies[0] if self.topologies else None

    def option_fields(self) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(self.options)}

    def parse_options(self, values: Mapping[str, Any], settings=None) -> AlgorithmOptions:
        """The options dataclass from raw values (already coerced to the field types); raises
        ValueError for a name it does not take or a value its validate() refuses."""
        fields = self.option_fields()
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"{', '.join(unknown)} {'does' if len(unknown) == 1 else 'do'} not apply to "
                             f"{self.name} (its options: {', '.join(fields) or 'none'})")
        parsed = self.options(**values)
        parsed.validate(settings)
        return parsed


_REGISTRY: dict[str, AlgorithmSpec] = {}


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Called by an algorithm module when it is imported."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"algorithm {spec.name!r} is registered twice")
    if not (dataclasses.is_dataclass(spec.options) and issubclass(spec.options, AlgorithmOptions)):
        raise TypeError(f"{spec.name}: options must be an AlgorithmOptions dataclass")
    for f in dataclasses.fields(spec.options):
        if "option" not in f.metadata:
            raise TypeError(f"{spec.name}: option {f.name} must be declared with option(...)")
    _REGISTRY[spec.name] = spec
    return spec


def _load() -> dict[str, AlgorithmSpec]:
    """Import every module of p2ptrain.algorithms once: an algorithm's module registers it."""
    if not _LOADED:
        package = importlib.import_module("p2ptrain.algorithms")
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{module.name}")
        _LOADED.append(True)
    return _REGISTRY


_LOADED: list[bool] = []


def algorithms() -> dict[str, AlgorithmSpec]:
    """Every registered algorithm, by name, in alphabetical order."""
    return dict(sorted(_load().items()))


def get(name: str) -> AlgorithmSpec:
    specs = algorithms()
    if name not in specs:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(specs)}")
    return specs[name]


def names() -> tuple[str, ...]:
    return tuple(algorithms())


def runs_parameter_server(name: str | None) -> bool:
    """Whether algorithm `name` runs as a parameter server and its workers (no name, or an unknown
    one: no; validating the settings says what is wrong with it)."""
    return name in algorithms() and get(name).role == "parameter-server"


def algorithm_for_role(role: str) -> str | None:
    """The algorithm a node of `role` runs when none is named: the parameter-server roles (ps,
    worker) run the first algorithm registered with role parameter-server; None for a peer (the
    settings' default algorithm)."""
    if role not in ("ps", "worker"):
        return None
    return next((name for name, spec in algorithms().items() if spec.role == "parameter-server"), None)


def all_options() -> dict[str, tuple[dataclasses.Field, tuple[str, ...]]]:
    """Every option name of every algorithm -> (its field, the algorithms taking it). An option
    that several algorithms take (e.g. compression) must be declared alike in each."""
    merged: dict[str, tuple[dataclasses.Field, tuple[str, ...]]] = {}
    for spec in algorithms().values():
        for name, f in spec.option_fields().items():
            if name in merged:
                known, users = merged[name]
                if (known.type, known.default, known.metadata["option"].choices) != (
                        f.type, f.default, f.metadata["option"].choices):
                    raise TypeError(f"option {name!r} is declared differently by {users[0]} and {spec.name}")
                merged[name] = (known, (*users, spec.name))
            else:
                merged[name] = (f, (spec.name,))
    return merged


def build(name: str, comm: "Comm", options: AlgorithmOptions, context: BuildContext) -> "Algorithm":
    """The algorithm `name`, configured by `options`, bound to `comm`."""
    spec = get(name)
    if spec.build is None:
        raise ValueError(f"{name} does not run on a peer node (role {spec.role})")
    if context.topology not in spec.topologies:
        raise ValueError(f"{name} cannot run on topology {context.topology!r}; choose from "
                         f"{', '.join(spec.topologies)}")
    return spec.build(comm, options, context)


__all__ = ["AlgorithmOptions", "AlgorithmSpec", "BuildContext", "OptionInfo",
           "algorithm_for_role", "algorithms", "all_options", "build", "get", "names", "option", "register",
           "runs_parameter_server"]
