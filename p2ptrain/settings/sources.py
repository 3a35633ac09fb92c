"""Where settings come from: defaults < TOML file < environment < command-line flags.

Environment: P2PTRAIN_<SETTING> for any setting (P2PTRAIN_PEERS="node0:50051,node1:50051",
P2PTRAIN_OVERLAP=1), which docker-compose uses, and below it what launchers set: torchrun's RANK /
WORLD_SIZE (or GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK), TORCHELASTIC_RUN_ID and MASTER_ADDR /
MASTER_PORT (the rendezvous store of a node given no peer list), Slurm's SLURM_PROCID / SLURM_NTASKS.
A list setting is one string there: peers and slow_windows comma-, link_overrides, link_bursts and
relay_routes semicolon-separated.
Values are coerced to the setting's type with an error naming it. A flag for another algorithm's
option is an error; a TOML file or environment shared by a cluster may carry them (kept apart as
ignored). Two sources giving different world sizes are a mistake, never an override.
"""
from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, NamedTuple, Union

import tomllib

from p2ptrain.addresses import join_address
from p2ptrain.algorithms import registry
from p2ptrain.settings.sections import SETTINGS, ConfigError, unwrap

LIST_SEPARATORS = {"link_overrides": ";", "relay_routes": ";", "link_bursts": ";", "slow_windows": ","}  # others: ","
# a TOML table {"SRC->DST" = REST} is a list of SRC->DST:REST
TABLE_SETTINGS = ("link_overrides", "relay_routes", "link_bursts")
_LAUNCHER_VARIABLES = {"world_size": ("WORLD_SIZE", "SLURM_NTASKS")}  # in the order _launcher_identity reads them
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class Gathered(NamedTuple):
    settings: dict[str, Any]  # coerced, by setting name
    options: dict[str, Any]   # the chosen algorithm's options, coerced
    ignored: dict[str, Any]   # other algorithms' options from a shared TOML file or the environment
    rank_given: bool          # some source named the rank


def gather(*, toml_path: str | Path | None, env: Mapping[str, str], flags: Mapping[str, Any],
           spelled: Mapping[str, str] = {}) -> Gathered:
    """Merge the sources (None-valued flags mean 'not given'; flags may carry a parser's other
    entries, which are skipped). A name that is neither a setting nor any algorithm's option is an
    error with the closest name. `spelled` names a flag in messages when the command spells it
    differently (launch: world_size is --nodes)."""
    toml = _from_toml(Path(toml_path)) if toml_path else {}
    environment = _from_env(env)
    options_known = registry.all_options()
    given = {k: v for k, v in flags.items() if v is not None and (k in SETTINGS or k in options_known)}
    _check_agreement("world_size", toml_path, toml, environment, given, spelled, env)
    values = {**toml, **environment, **given}
    serving = registry.algorithm_for_role(str(values.get("role", "peer")))
    if serving is not None and "algorithm" not in values:
        values["algorithm"] = serving  # the parameter-server roles run the algorithm that serves them
    if values.get("role", "peer") == "peer" and not values.get("peers"):
        _rendezvous_from_launcher(values, env)
    settings = {k: coerce(k, v, SETTINGS[k].type) for k, v in values.items() if k in SETTINGS}
    algorithm = str(settings.get("algorithm", SETTINGS["algorithm"].default))
    taken = typing.get_type_hints(registry.get(algorithm).options) if algorithm in registry.names() else {}
    options, ignored = {}, {}
    for name, value in values.items():
        if name in SETTINGS:
            continue
        if name in taken:
            options[name] = coerce(name, value, taken[name])
        elif name in given:
            users = options_known[name][1]
            raise ConfigError(f"--{name.replace('_', '-')} does not apply to {algorithm} (it is an option of "
                              f"{', '.join(users)})")
        else:
            ignored[name] = value
    return Gathered(settings, options, ignored, "rank" in values)


def env_variables(settings: Mapping[str, Any]) -> dict[str, str]:
    """P2PTRAIN_<SETTING> variables for settings (None: not given), the way gather() reads them
    back: how `p2ptrain launch` hands its flags to a script of your own. The auth token is never
    among them (launch passes it apart)."""
    env = {}
    for name, value in settings.items():
        if value is None or name == "auth_token":
            continue
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, (list, tuple)):
            text = LIST_SEPARATORS.get(name, ",").join(map(str, value))
        else:
            text = str(value)
        env[f"P2PTRAIN_{name.upper()}"] = text
    return env


# -- values ----------------------------------------------------------------------------------------
def coerce(name: str, value: Any, kind: Any) -> Any:
    """A value from TOML or the environment as the setting's type `kind` (a resolved annotation),
    or a ConfigError naming the setting."""
    optional, base = unwrap(kind)
    try:
        if base is list:
            return _as_list(name, value)
        if name == "relays" and isinstance(value, (list, tuple)):  # TOML: relays = [1, 2]
            return ",".join(str(v) for v in value)
        if name == "auth_token" and isinstance(value, str):
            return value  # "" must fail validation, not silently mean "no token"
        if value is None or (optional and isinstance(value, str) and value.lower() in ("", "none")):
            return None
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
                return value.strip().lower() in _TRUE
            raise TypeError("not a boolean")
        if isinstance(value, bool) and base in (int, float):
            raise TypeError("a boolean is not a number")  # int(True) would silently give 1
        if base is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("fractional value")  # int(1.5) would silently truncate
            return int(value)
        if base is float:
            return float(value)
        return str(value)  # str, and the names of a Literal (checked by the setting's group)
    except (TypeError, ValueError):
        raise ConfigError(f"setting {name}={value!r} is not a valid {_describe(kind)}") from None


def _describe(kind: Any) -> str:
    if typing.get_origin(kind) in (Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(kind))
    if typing.get_origin(kind) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(kind)))
    return "None" if kind is type(None) else getattr(typing.get_origin(kind) or kind, "__name__", str(kind))


def _as_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [e.strip() for e in value.split(LIST_SEPARATORS.get(name, ",")) if e.strip()]
    if isinstance(value, Mapping) and name in TABLE_SETTINGS:
        return [f"{k}:{v}" for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [str(e) for e in value]
    raise TypeError("not a list")


# -- the sources -----------------------------------------------------------------------------------
def _from_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    if isinstance(data.get("node"), dict):  # allow a [node] table or top-level keys, not both
        outside = sorted(set(data) - {"node"})
        if outside:
            raise ConfigError(f"config file {path}: setting(s) {outside} outside the [node] table; "
                              "put every setting inside [node] (or use no table at all)")
        data = data["node"]
    unknown = sorted(set(data) - set(SETTINGS) - set(registry.all_options()))
    if unknown:
        raise ConfigError(f"config file {path}: {_unknown_settings(unknown)}")
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = dict(_launcher_identity(env))
    for name in [*SETTINGS, *registry.all_options()]:
        key = f"P2PTRAIN_{name.upper()}"
        if key in env:
            values[name] = env[key]
    return values


def _launcher_identity(env: Mapping[str, str]) -> dict[str, str]:
    """Rank, world size and run id as torchrun or Slurm set them (P2PTRAIN_* overrides them)."""
    values: dict[str, str] = {}
    if "RANK" in env:
        values["rank"] = env["RANK"]
    elif all(env.get(k, "").isdigit() for k in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")):
        values["rank"] = str(int(env["GROUP_RANK"]) * int(env["LOCAL_WORLD_SIZE"]) + int(env["LOCAL_RANK"]))
    elif "SLURM_PROCID" in env:
        values["rank"] = env["SLURM_PROCID"]
    if "WORLD_SIZE" in env:
        values["world_size"] = env["WORLD_SIZE"]
    elif "SLURM_NTASKS" in env:
        values["world_size"] = env["SLURM_NTASKS"]
    if env.get("TORCHELASTIC_RUN_ID"):
        restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        # torchrun restarts every worker as a new round: a fresh rendezvous, never the last round's keys
        values["run_id"] = env["TORCHELASTIC_RUN_ID"] + (f"-restart{restarts}" if restarts not in ("", "0") else "")
    return values


def _rendezvous_from_launcher(values: dict[str, Any], env: Mapping[str, str]) -> None:
    """A node given no peer list: the store at MASTER_ADDR:MASTER_PORT (torchrun's, Slurm scripts')
    unless one is named; a rendezvous needs a world size."""
    if values.get("rendezvous") is None and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        values["rendezvous"] = join_address(env["MASTER_ADDR"], env["MASTER_PORT"])
    if values.get("rendezvous") is None:
        return
    if "world_size" not in values:
        raise ConfigError("a rendezvous needs the number of nodes: --world-size N (or WORLD_SIZE / SLURM_NTASKS "
                          "from torchrun / Slurm)")


def _check_agreement(name: str, toml_path, toml: Mapping, environment: Mapping, flags: Mapping,
                     spelled: Mapping[str, str], env: Mapping[str, str]) -> None:
    """A setting two sources give differently is a mistake, not an override (e.g. a world size of 4
    in the TOML, WORLD_SIZE=8 from the environment and --nodes 3): say which is which."""
    present = []
    if toml.get(name) is not None:
        present.append((f"{name} = {toml[name]!r} in {toml_path}", str(toml[name]).strip()))
    if environment.get(name) is not None:
        variable = next((v for v in (f"P2PTRAIN_{name.upper()}", *_LAUNCHER_VARIABLES.get(name, ())) if v in env),
                        name.upper())
        present.append((f"{variable}={environment[name]} in the environment", str(environment[name]).strip()))
    if flags.get(name) is not None:
        flag = spelled.get(name, f"--{name.replace('_', '-')}")
        present.append((f"{flag} {flags[name]}", str(flags[name]).strip()))
    if len({value for _, value in present}) > 1:
        raise ConfigError(f"conflicting {name.replace('_', ' ')}s: " + " vs ".join(where for where, _ in present))


def _unknown_settings(names: list[str]) -> str:
    """"unknown setting(s) [...]" with the closest known name for each, if any is close."""
    known = [*SETTINGS, *registry.all_options()]
    hints = [f"{name!r} -> {close[0]!r}" for name in names
             if (close := difflib.get_close_matches(name, known, n=1))]
    return f"unknown setting(s) {names}" + (f"; did you mean {', '.join(hints)}?" if hints else "")


__all__ = ["Gathered", "LIST_SEPARATORS", "TABLE_SETTINGS", "coerce", "env_variables", "gather"]
