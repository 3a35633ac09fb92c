"""The node's command-line flags, generated from the settings' declarations (settings/sections.py)
and the algorithm registry's options, and the way back from parsed flags to a NodeConfig.

Flags default to None, so a flag not given never overrides TOML or the environment
(NodeConfig.from_sources merges them). Every setting is a flag of `p2ptrain node`; launchers leave
out the per-node ones (rank, peers, ...), which they set for each process themselves.
"""
from __future__ import annotations

import argparse
import typing
from typing import Any

from p2ptrain.algorithms import registry
from p2ptrain.settings import DEFAULT_LR, SETTINGS, NodeConfig, Setting
from p2ptrain.settings.sections import unwrap
from p2ptrain.settings.sources import LIST_SEPARATORS

# (title, description) of each group's flags in --help
TITLES = {"cluster": ("cluster", None), "training": ("training", None), "data": ("data", None),
          "transport": ("transport", None), "faults": ("fault and WAN emulation", "off by default"),
          "security": ("security", "TLS and a shared-secret token for every RPC (default: plaintext, open)"),
          "output": ("output", None)}


def add_node_arguments(parser: argparse.ArgumentParser, *, cluster_flags: bool = True) -> list[argparse.Action]:
    """Add the node's flags (without the per-node ones unless `cluster_flags`) and --config;
    returns the actions added, the one list of the flags' spellings (node_flags_as_argv)."""
    actions: list[argparse.Action] = []
    groups: dict[str, Any] = {}
    for setting in SETTINGS.values():
        if setting.info.per_node and not cluster_flags:
            continue
        if setting.section not in groups:
            groups[setting.section] = parser.add_argument_group(*TITLES[setting.section])
            if setting.section == "training":
                groups["options"] = parser.add_argument_group(
                    "algorithm options", "each applies to the algorithms it names")
                actions += add_algorithm_options(groups["options"])
        actions.append(_add_flag(groups[setting.section], setting))
    actions.append(parser.add_argument("--config", dest="config_file",
                                       help="TOML file with settings (flags and env override it)"))
    return actions


def _add_flag(group, setting: Setting) -> argparse.Action:
    info, kind = setting.info, unwrap(setting.type)[1]
    spellings = info.flags or (f"--{setting.name.replace('_', '-')}",)
    text = info.help.format(default=setting.default) + _help_tail(setting.name)
    if kind is bool and setting.default:  # on unless turned off: --X / --no-X, absent means not given
        return group.add_argument(*spellings, dest=setting.name, action=argparse.BooleanOptionalAction, default=None,
                                  help=text)
    if kind is bool:  # a switch: given means true, absent means not given
        return group.add_argument(*spellings, dest=setting.name, action="store_true", default=None, help=text)
    if kind is list and setting.name in LIST_SEPARATORS:  # repeatable, kept joined as in the environment
        return group.add_argument(*spellings, dest=setting.name, action=_JoinAppend, metavar=info.metavar, help=text,
                                  const=LIST_SEPARATORS[setting.name])
    choices = registry.names() if setting.name == "algorithm" else setting.choices
    return group.add_argument(*spellings, dest=setting.name, type=kind if kind in (int, float) else str,
                              choices=choices, metavar=info.metavar, help=text)


def _help_tail(name: str) -> str:
    """What the algorithm registry and the default learning rates add to a flag's help."""
    specs = registry.algorithms()
    if name == "algorithm":
        return ": " + "; ".join(f"{n}: {spec.summary}" for n, spec in specs.items())
    if name == "topology":
        return "; default per algorithm: " + ", ".join(
            f"{n} {spec.default_topology}" for n, spec in specs.items() if spec.default_topology)
    if name == "lr":
        return " (default per model: " + ", ".join(f"{m} {v}" for m, v in DEFAULT_LR.items()) + ")"
    return ""


class _JoinAppend(argparse.Action):
    """A repeatable flag kept as one string joined with its separator (`const`, the environment's
    form), so that `p2ptrain launch` can pass it on to its node processes as a single flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{previous}{self.const}{values}" if previous else values)


def add_algorithm_options(group) -> list[argparse.Action]:
    """One flag per algorithm option (shared by several algorithms: one flag); its help names the
    algorithms that take it, each with its own text where they mean different things (SGP's and
    allreduce's --overlap). Defaults stay None, so only given flags reach NodeConfig."""
    actions = []
    for name, (f, users) in registry.all_options().items():
        info = f.metadata["option"]
        kind = unwrap(typing.get_type_hints(registry.get(users[0]).options)[name])[1]
        default = f.default if f.default is not None else "none"
        helps: dict[str, list[str]] = {}
        for user in users:
            helps.setdefault(registry.get(user).option_fields()[name].metadata["option"].help, []).append(user)
        text = "; ".join(f"{'/'.join(names)}: {help}" for help, names in helps.items())
        if kind is bool:  # a switch, like --join (--X / --no-X where on by default): absent means not given
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            actions.append(group.add_argument(f"--{name.replace('_', '-')}", action=action, default=None,
                                              help=f"{text} (default {'on' if f.default else 'off'})"))
            continue
        actions.append(group.add_argument(f"--{name.replace('_', '-')}", type=kind if kind in (int, float) else str,
                                          choices=info.choices,
                                          metavar=info.metavar, help=f"{text} (default {default})"))
    return actions


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (None: not given), for NodeConfig.from_sources."""
    names = set(SETTINGS) | set(registry.all_options())
    return {k: v for k, v in vars(args).items() if k in names}


def config_from_args(args: argparse.Namespace, **overrides: Any) -> NodeConfig:
    """The validated NodeConfig of parsed flags (and their --config file), `overrides` on top."""
    flags = flags_from_args(args)
    flags.update(overrides)
    spelled = {"world_size": "--nodes"} if getattr(args, "command", None) == "launch" else {}
    return NodeConfig.from_sources(toml_path=getattr(args, "config_file", None), flags=flags, spelled=spelled)


def node_flags_as_argv(args: argparse.Namespace) -> list[str]:
    """The node flags given to a launcher, as argv for each of its node processes (the auth token
    never: it goes by environment, where other users cannot read it)."""
    argv: list[str] = []
    for action in add_node_arguments(argparse.ArgumentParser(add_help=False), cluster_flags=False):
        value = getattr(args, action.dest, None)
        if value is None or action.dest == "auth_token":
            continue
        if action.nargs == 0:  # a switch: the flag alone (--no-X: a default-on switch turned off)
            if value:
                argv.append(action.option_strings[0])
            elif isinstance(action, argparse.BooleanOptionalAction):
                argv.append(action.option_strings[1])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def node_config_from_argv(prog: str, description: str, argv: list[str] | None = None) -> NodeConfig:
    """A validated NodeConfig from node flags (and --config): for programs that run one rank of a
    cluster the launcher starts with node flags, such as the baselines of `bench peers`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_node_arguments(parser)
    return config_from_args(parser.parse_args(argv))


__all__ = ["add_algorithm_options", "add_node_arguments", "config_from_args", "flags_from_args",
           "node_config_from_argv", "node_flags_as_argv"]
