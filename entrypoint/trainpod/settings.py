"""Every setting trainpod reads, declared once: flag, variable, type and bounds, default, help.

    CONNECT_TIMEOUT = Setting("connect_timeout", "seconds to wait for the master ...",
                              Number(above=0), var="TRAINPOD_CONNECT_TIMEOUT", default=300.0)

The CLI's flags, their help text, parsing and validation come from these declarations (as torch's
launcher derives its PET_* twins from its flags), and so do the bundled examples' options: a job
often sets variables more easily than it edits a command line. The cluster environments declare
their own settings beside their code (`ClusterEnvironment.settings`).

Precedence: the flag, then the variable, then the default. A value that does not parse names
where it came from: a flag's is a usage error (64: fix the command), a variable's a configuration
error (78: fix the job). Numbers are ASCII digits only (Python's int() would take '٢' or '1_0'),
floats are finite, counts have upper bounds: a typo is refused here, not met as a hang later.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from trainpod.errors import UsageError, invalid
from trainpod.text import printable

__all__ = [
    "ArgumentParser", "Boolean", "Choice", "Host", "Integer", "Invalid", "NodeRange", "Number", "ProcessCount", "Setting", "Switch",
    "Text",
    "Values", "add_arguments", "parse_args", "repeated", "resolve",
]


class Invalid(ValueError):
    """Raised by a kind: the text says what was expected ("an integer from 1 to 65536")."""


# --- kinds: text (or an already typed value) -> value, or Invalid --------------------------------

_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Integer:
    minimum: int = 0
    maximum: int | None = None

    def expected(self) -> str:
        if self.maximum is None:
            return f"an integer >= {self.minimum}"
        return f"an integer from {self.minimum} to {self.maximum}"

    def __call__(self, value: Any) -> int:
        if isinstance(value, bool):
            raise Invalid(self.expected())
        if isinstance(value, int):
            number = value
        else:
            text = str(value).strip()
            # ASCII digits only: int() also takes other scripts' digits and underscores.
            if not _INTEGER.fullmatch(text) or len(text) > 20:
                raise Invalid(self.expected())
            number = int(text)
        if number < self.minimum or (self.maximum is not None and number > self.maximum):
            raise Invalid(self.expected())
        return number


@dataclass(frozen=True)
class Number:
    """A finite number; `above` is an exclusive lower bound, `minimum` an inclusive one."""

    minimum: float | None = None
    above: float | None = None
    unit: str = "seconds"

    def expected(self) -> str:
        bound = f" above {self.above:g}" if self.above is not None else f" >= {self.minimum:g}" if self.minimum is not None else ""
        return f"a number of {self.unit}{bound}" if self.unit else f"a number{bound}"

    def __call__(self, value: Any) -> float:
        if isinstance(value, bool):
            raise Invalid(self.expected())
        if isinstance(value, (int, float)):
            number = float(value)
        else:
            text = str(value).strip()
            if not _NUMBER.fullmatch(text):  # no nan, inf, '1_0' or other scripts' digits
                raise Invalid(self.expected())
            number = float(text)
        if not math.isfinite(number):
            raise Invalid(self.expected())
        if (self.above is not None and number <= self.above) or (self.minimum is not None and number < self.minimum):
            raise Invalid(self.expected())
        return number


@dataclass(frozen=True)
class Choice:
    choices: tuple[str, ...]

    def expected(self) -> str:
        return f"one of {', '.join(self.choices)}"

    def __call__(self, value: Any) -> str:
        text = str(value).strip()
        if text not in self.choices:
            raise Invalid(self.expected())
        return text


@dataclass(frozen=True)
class Text:
    def expected(self) -> str:
        return "a non-empty value"

    def __call__(self, value: Any) -> str:
        text = str(value).strip()
        if not text:
            raise Invalid(self.expected())
        return text


@dataclass(frozen=True)
class Boolean:
    """On the command line --name / --no-name; as a variable 1/true/yes/on or 0/false/no/off."""

    def expected(self) -> str:
        return "1, true, yes, on, or 0, false, no, off"

    def __call__(self, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text not in _TRUE + _FALSE:
            raise Invalid(self.expected())
        return text in _TRUE


@dataclass(frozen=True)
class ProcessCount:
    """Processes per node: an integer, or "auto"/"gpu" (torchrun's words): one per visible GPU."""

    maximum: int = 1024

    def expected(self) -> str:
        return f"an integer from 1 to {self.maximum}, or auto (one per visible GPU)"

    def __call__(self, value: Any) -> int | str:
        if str(value).strip() in ("auto", "gpu"):
            return "auto"
        try:
            return Integer(1, self.maximum)(value)
        except Invalid:
            raise Invalid(self.expected()) from None


@dataclass(frozen=True)
class NodeRange:
    """A node count, or torchrun's elastic range MIN:MAX: (min, max), equal for a fixed-size job."""

    maximum: int = 65536

    def expected(self) -> str:
        return f"a node count from 1 to {self.maximum}, or MIN:MAX with 1 <= MIN <= MAX <= {self.maximum}"

    def __call__(self, value: Any) -> tuple[int, int]:
        if isinstance(value, tuple):
            low, high = value
        else:
            text = str(value).strip()
            low_text, sep, high_text = text.partition(":")
            try:
                low = Integer(1, self.maximum)(low_text)
                high = Integer(1, self.maximum)(high_text) if sep else low
            except Invalid:
                raise Invalid(self.expected()) from None
        if not 1 <= low <= high <= self.maximum:
            raise Invalid(self.expected())
        return low, high


@dataclass(frozen=True)
class RendezvousId:
    """A job's identity, kept exactly (trainpod.rendezvous.ids escapes it for etcd); no control characters."""

    def expected(self) -> str:
        return "a job id of printable characters (any: they are escaped for etcd, one-to-one)"

    def __call__(self, value: Any) -> str:
        from trainpod.rendezvous import ids

        text = str(value)
        try:
            return ids.check(text if text.strip() else "")
        except ValueError as bad:
            raise Invalid(str(bad)) from None


@dataclass(frozen=True)
class Secret:
    """A password: taken as given, never parsed here, so that no error line can show it."""

    def expected(self) -> str:
        return "a password"

    def __call__(self, value: Any) -> str:
        return str(value)


@dataclass(frozen=True)
class RdzvConf:
    """torchrun's --rdzv-conf: KEY=VALUE pairs, comma-separated, as a dict."""

    def expected(self) -> str:
        return "KEY=VALUE pairs separated by commas (keep_alive_interval=2,last_call_timeout=5)"

    def __call__(self, value: Any) -> dict[str, str]:
        if isinstance(value, Mapping):
            return {str(k): str(v) for k, v in value.items()}
        pairs = {}
        for item in str(value).split(","):
            key, sep, val = item.strip().partition("=")
            if not item.strip():
                continue
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()) or not val.strip() or "," in val:
                raise Invalid(self.expected())
            pairs[key.strip()] = val.strip()
        if not pairs:
            raise Invalid(self.expected())
        return pairs


def format_range(nodes: tuple[int, int]) -> str:
    """'2' for a fixed-size job, '1:4' for an elastic one (torchrun's --nnodes)."""
    return str(nodes[0]) if nodes[0] == nodes[1] else f"{nodes[0]}:{nodes[1]}"


class Switch(Boolean):
    """A flag that takes no value (--no-supervise); its variable is a Boolean."""


@dataclass(frozen=True)
class Host:
    """A host name, an IPv4 or an IPv6 literal (brackets stripped only around an IPv6 literal).

    Checked without any network I/O: 'host:port', two words or an empty value are refused here
    rather than met as an unreachable master, which would be retried.
    """

    def expected(self) -> str:
        return "a host name or an IP address, without a port"

    def __call__(self, value: Any) -> str:
        text = str(value).strip()
        if text.startswith("[") and text.endswith("]"):
            inner = text[1:-1]
            if _ip_version(inner) == 6:
                return inner
            raise Invalid(self.expected())
        if _ip_version(text):
            return text
        # RFC 1123 labels; underscores too, which container runtimes allow in service names.
        labels = text.rstrip(".").split(".")
        if (
            0 < len(text) <= 253
            and text.isascii()
            and all(re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?", label) for label in labels)
            and not re.fullmatch(r"[0-9.]+", text)  # '10.0.0' or '999.1.1.1' is a broken address, not a name
        ):
            return text
        raise Invalid(self.expected())


def _ip_version(text: str) -> int | None:
    try:
        return ipaddress.ip_address(text).version
    except ValueError:
        return None


# --- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    name: str  # the attribute: "connect_timeout"; the flag is derived from it: --connect-timeout
    help: str
    kind: Callable[[Any], Any] = field(default_factory=Text)
    var: str | None = None  # the variable twin (TRAINPOD_*); None: a flag only
    default: Any = None  # None: not given (the caller then decides, e.g. from the visible GPUs)
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, value: Any, origin: str) -> Any:
        """`value` as this setting's type; a one-line error naming `origin` (64 for a flag, 78 else)."""
        try:
            return self.kind(value)
        except Invalid as bad:
            raise invalid(origin, value, str(bad)) from None

    def from_env(self, env: Mapping[str, str]) -> tuple[Any, str]:
        """(value, origin) from the variable, else the default."""
        if self.var and env.get(self.var, "").strip():
            return self.parse(env[self.var], self.var), self.var
        return self.default, "default"

    def describe(self) -> str:
        details = []
        if self.default is not None and not isinstance(self.kind, Switch):
            details.append(f"default {self.default:g}" if isinstance(self.default, float) else f"default {self.default}")
        if self.var:
            details.append(f"env {self.var}")
        return f"{self.help} ({'; '.join(details)})" if details else self.help


class Values:
    """Resolved settings: attribute access, plus `origins` (name -> the flag, variable or "default")."""

    def __init__(self, values: Mapping[str, Any], origins: Mapping[str, str]):
        self.__dict__.update(values)
        self.origins = dict(origins)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k != "origins")
        return f"Values({shown})"


def resolve(settings: Iterable[Setting], flags: Mapping[str, Any], env: Mapping[str, str]) -> Values:
    """Each setting from its flag (a value in `flags` that is not None), else its variable, else its default."""
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for setting in settings:
        given = flags.get(setting.name)
        if given is not None:
            values[setting.name], origins[setting.name] = setting.parse(given, setting.flag), setting.flag
        else:
            values[setting.name], origins[setting.name] = setting.from_env(env)
    return Values(values, origins)


REPEATED = "flag_warnings"  # a parsed namespace's list: a line for each flag given again with another value


def repeated(namespace: argparse.Namespace) -> list[str]:
    """The lines that say which flags were given more than once with different values, and which value counts."""
    return list(getattr(namespace, REPEATED, []))


class _Noted:
    """An action that notes a flag given again with another value: argparse keeps the last one silently, and a job
    script that appends an override (`trainpod run $COMMON --nnodes 4`) or repeats a flag by mistake is then told
    which value counts. The last one still wins, as with every tool that parses flags so."""

    option_strings: list[str]
    dest: str

    def _note(self, namespace: argparse.Namespace, before: Any) -> None:
        after = getattr(namespace, self.dest)
        if before is not None and after != before:
            lines = namespace.__dict__.setdefault(REPEATED, [])
            lines.append(f"{self.option_strings[0]} given more than once ({self._shown(before)}, then {self._shown(after)}): "
                         "the last one counts")

    def _shown(self, value: Any) -> str:
        if isinstance(value, bool):  # --flag / --no-flag
            return self.option_strings[0] if value else self.option_strings[-1]
        return printable(shlex.quote(value))


class _Store(_Noted, argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values)
        self._note(namespace, before)


class _BooleanOptional(_Noted, argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option_string)
        self._note(namespace, before)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 64 (UsageError), not a usage dump and 2; and a flag is
    its whole name: argparse's default takes `--max-restart` for `--max-restarts`, so a script that worked would
    stop at its next release when a flag sharing the prefix comes, or mean another flag than it says.
    `named=False`: its errors do not start with its name (the CLI's, whose error lines already do)."""

    def __init__(self, *args, allow_abbrev: bool = False, named: bool = True, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)
        self.named = named

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}" if self.named else message)

    def parse_args(self, args=None, namespace=None):
        # argparse joins the arguments it does not know with spaces: an empty one, or one holding a space, was not seen
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:  # said by the (sub)command they were given to: `trainpod explain: unrecognized arguments: ...`
            self._chosen(parsed).error(f"unrecognized arguments: {shlex.join(unknown)}")
        return parsed

    def _chosen(self, parsed) -> argparse.ArgumentParser:
        """The innermost subcommand's parser that `parsed` went through (this one if none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
                chosen = action.choices[getattr(parsed, action.dest)]
                return chosen._chosen(parsed) if isinstance(chosen, ArgumentParser) else chosen
        return self


def add_arguments(parser: argparse.ArgumentParser, settings: Iterable[Setting], title: str | None = None) -> None:
    """Flags for `settings`; each stores its raw text (None when not given) for resolve() to parse,
    so that a bad value is reported the same way whether it came from the flag or the variable."""
    group = parser.add_argument_group(title) if title else parser
    for setting in settings:
        if isinstance(setting.kind, Switch):
            group.add_argument(setting.flag, dest=setting.name, action="store_const", const=True, default=None,
                               help=setting.describe())
        elif isinstance(setting.kind, Boolean):
            group.add_argument(setting.flag, dest=setting.name, action=_BooleanOptional, default=None,
                               help=setting.describe())
        else:
            group.add_argument(setting.flag, dest=setting.name, action=_Store, metavar=setting.metavar or _metavar(setting.kind),
                               default=None, help=setting.describe())


def _metavar(kind: Callable[[Any], Any]) -> str:
    if isinstance(kind, Choice):
        return "{" + ",".join(kind.choices) + "}"
    if isinstance(kind, Number):
        return "SECONDS" if kind.unit == "seconds" else "X"
    return {Integer: "N", ProcessCount: "N|auto", Host: "HOST", NodeRange: "N|MIN:MAX", RdzvConf: "KEY=VALUE,..."}.get(type(kind), "VALUE")


def parse_args(
    prog: str, description: str, settings: Sequence[Setting], argv: Sequence[str] | None, env: Mapping[str, str],
    warnings: list[str] | None = None,
) -> Values:
    """A script's options (the bundled examples'): flags, then variables, then defaults; one-line errors. A flag
    given again with another value: a line in `warnings`, where the caller says them (once per job, not per rank)."""
    parser = ArgumentParser(prog=prog, description=description)
    add_arguments(parser, settings)
    args = parser.parse_args(argv)
    if warnings is not None:
        warnings += [f"{prog}: {line}" for line in repeated(args)]
    return resolve(settings, vars(args), env)


# --- trainpod's own settings ---------------------------------------------------------------------
# The cluster sources declare theirs in environments/ (and --source beside their registry); the
# bundled examples declare their options in their modules. Topology flags have no TRAINPOD_*
# twin where the cluster's own variables (PET_NNODES, MASTER_ADDR, PAI_*, ...) are the twin.

MAX_NODES = 65536
MAX_NPROC = 1024
BACKENDS = ("gloo", "nccl")

NNODES = Setting("nnodes", "number of nodes, or MIN:MAX for an elastic job (nodes may leave and join; needs a "
                 "rendezvous backend: --rdzv-backend)", NodeRange(MAX_NODES))
NODE_RANK = Setting("node_rank", "this node's rank, 0 = master", Integer(0, MAX_NODES - 1))
NPROC_PER_NODE = Setting(
    "nproc_per_node", "processes per node, or auto: one per visible GPU (default: PET_NPROC_PER_NODE, else one per "
    "visible GPU, else 1)", ProcessCount(MAX_NPROC), var="TRAINPOD_NPROC_PER_NODE")
MASTER_ADDR = Setting("master_addr", "the master's address: a host name or an IP address", Host())
MASTER_PORT = Setting("master_port", "the master's port", Integer(1, 65535))
BACKEND = Setting("backend", "collective backend (default: nccl with GPUs, else gloo)", Choice(BACKENDS), var="TRAINPOD_BACKEND")
INTERFACE = Setting("interface", "network interface for gloo/NCCL (default: GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME, "
                    "else the one that carries the route to the master)", metavar="IFNAME")
# The rendezvous: how the nodes' agents meet (trainpod.topology.Rendezvous). c10d is hosted by one
# node's agent (a single point of failure); etcd and etcd-v3 keep the state in an etcd cluster.
RDZV_BACKENDS = ("c10d", "etcd", "etcd-v3")
RDZV_BACKEND = Setting(
    "rdzv_backend", "where the nodes meet: c10d (default; node 0's agent hosts the store on the master port: losing "
    "that node ends the job), etcd (torch's, etcd's v2 API: etcd 3.4/3.5 with --enable-v2) or etcd-v3 (trainpod's, "
    "etcd's v3 API: any etcd from 3.4 on)", Choice(RDZV_BACKENDS), var="TRAINPOD_RDZV_BACKEND")
RDZV_ENDPOINT = Setting(
    "rdzv_endpoint", "the rendezvous endpoint: etcd's [https://]host:port[,...] (https: TLS, see --etcd-cacert; no "
    "user:password@: see --etcd-user), or c10d's host:port (default: the master's address and port)",
    var="TRAINPOD_RDZV_ENDPOINT", metavar="HOST:PORT[,...]")
RDZV_ID = Setting(
    "rdzv_id", "the job's rendezvous id, the same on every node (default: from the job's identity: OpenPAI's job "
    "and attempt, SLURM's job and step, else a digest of the job); with etcd, each run of the job gets a fresh "
    "generation of it; kept exactly: characters other than letters, digits, '.', '_', '-' and '~' are escaped as @XX "
    "(team/a -> team@2Fa), control characters refused", RendezvousId(), var="TRAINPOD_RDZV_ID", metavar="ID")
RDZV_CONF = Setting(
    "rdzv_conf", "torchrun's --rdzv-conf KEY=VALUE,... over trainpod's (an elastic job's: keep_alive_interval=1, "
    "keep_alive_max_attempt=3, last_call_timeout=3; etcd: last_call_timeout=3, keep_alive_ttl=4, trainpod's key for "
    "torch's fixed 10 s keep-alive TTL); every key and value is checked against what the backend reads "
    "(trainpod.rendezvous.conf)", RdzvConf(), var="TRAINPOD_RDZV_CONF",
    metavar="KEY=VALUE,...")
SPARES = Setting(
    "spares", "an elastic job's spare nodes: started beyond --nnodes' maximum, each waits warm (its agent and torch "
    "started), trains nothing, restarts nobody, and takes the place of the first node that leaves, at the same world "
    "size; needs the c10d or etcd-v3 rendezvous (torch's etcd backend restarts the job for every node beyond the "
    "maximum); the job's nodes take the same value, its spares are started as more of them", Integer(0, MAX_NODES),
    var="TRAINPOD_SPARES", default=0)
# etcd as production runs it (trainpod.rendezvous.etcd_http.EtcdAccess): TLS with an https:// endpoint, and a
# user of etcd's authentication. The names are etcdctl's (--cacert, --cert, --key, --user), prefixed. The
# password has no flag (a flag's value shows in `ps` and in job files): a file, or a variable.
ETCD_CACERT = Setting(
    "etcd_cacert", "the CA certificate(s) (PEM) that signed etcd's server certificate, for an https:// "
    "--rdzv-endpoint (default: the system's CAs)", var="TRAINPOD_ETCD_CACERT", metavar="PATH")
ETCD_CERT = Setting(
    "etcd_cert", "this node's client certificate (PEM) for etcd started with --client-cert-auth; with --etcd-key",
    var="TRAINPOD_ETCD_CERT", metavar="PATH")
ETCD_KEY = Setting("etcd_key", "the private key (PEM) of --etcd-cert", var="TRAINPOD_ETCD_KEY", metavar="PATH")
ETCD_USER = Setting(
    "etcd_user", "the etcd user to authenticate as (etcd's auth enabled); its password comes from "
    "--etcd-password-file or the variable TRAINPOD_ETCD_PASSWORD, never from a flag", var="TRAINPOD_ETCD_USER",
    metavar="NAME")
ETCD_PASSWORD_FILE = Setting(
    "etcd_password_file", "a file that holds --etcd-user's password (one trailing newline is ignored)",
    var="TRAINPOD_ETCD_PASSWORD_FILE", metavar="PATH")
ETCD_PASSWORD = Setting("etcd_password", "--etcd-user's password (a variable only: never a flag)", Secret(),
                        var="TRAINPOD_ETCD_PASSWORD")  # not in any flag table
ETCD_ACCESS = (ETCD_CACERT, ETCD_CERT, ETCD_KEY, ETCD_USER, ETCD_PASSWORD_FILE)
RENDEZVOUS = (RDZV_BACKEND, RDZV_ENDPOINT, RDZV_ID, RDZV_CONF, SPARES, *ETCD_ACCESS)
TOPOLOGY = (NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT, BACKEND, INTERFACE, *RENDEZVOUS)

CONNECT_TIMEOUT = Setting("connect_timeout", "seconds to wait for the master (DNS and port) before exit 69",
                          Number(above=0), var="TRAINPOD_CONNECT_TIMEOUT", default=300.0)
MAX_RESTARTS = Setting(
    "max_restarts", "restarts without progress after a failure, one budget for both layers: torchrun restarts the "
    "worker group at once when a rank fails, supervisord restarts the agent with exponential backoff; a newer "
    "committed checkpoint gives the budget back, the same failure twice without progress ends the job", Integer(0, 10000),
    var="TRAINPOD_MAX_RESTARTS", default=3)
RESTART_BACKOFF = Setting("restart_backoff", "seconds before the first restart of the agent, doubling each time",
                          Number(minimum=0), var="TRAINPOD_RESTART_BACKOFF", default=1.0)
TERM_GRACE = Setting(
    "term_grace", "seconds the ranks get after SIGTERM to finish the step and save a checkpoint before they are "
    "killed; give the container this plus 30 s to stop", Number(above=0), var="TRAINPOD_TERM_GRACE",
    default=25.0)  # under Kubernetes' default terminationGracePeriodSeconds of 30
PROGRESS_WINDOW = Setting(
    "progress_window", "a job that commits no checkpoints made progress when an attempt ran this long: the restart "
    "budget is full again (a newer committed checkpoint always gives it back)", Number(above=0),
    var="TRAINPOD_PROGRESS_WINDOW", default=600.0)
REJOIN_TIMEOUT = Setting(
    "rejoin_timeout", "seconds a node waits for a master that went away after the job started, then exits 69 "
    "without restarting (before the start, --connect-timeout applies)", Number(above=0),
    var="TRAINPOD_REJOIN_TIMEOUT", default=60.0)
NO_SUPERVISE = Setting(
    "no_supervise", "exec torchrun directly, without supervisord: failed ranks are still restarted by torchrun "
    "(up to --max-restarts), a failed agent is not", Switch(), var="TRAINPOD_NO_SUPERVISE", default=False)
LOCK_TIMEOUT = Setting(
    "lock_timeout", "one job per checkpoint and output directory: a job holds them with a lock file whose heartbeat "
    "it writes every third of this; another job is refused (78) while the heartbeat moves, and takes over a "
    "directory whose heartbeat stopped this long (trainpod.supervisor.dirlock); 0 turns the lock off", Number(minimum=0),
    var="TRAINPOD_LOCK_TIMEOUT", default=30.0)
SUPERVISION = (MAX_RESTARTS, RESTART_BACKOFF, PROGRESS_WINDOW, REJOIN_TIMEOUT, TERM_GRACE, NO_SUPERVISE, LOCK_TIMEOUT)

HANG_TIMEOUT = Setting(
    "hang_timeout", "seconds a rank may wait in a collective for a rank that is stopped, idle or gone (or every rank "
    "be idle outside a collective) before the agent writes every rank's stack to TRAINPOD_OUTPUT_DIR/hangs, names the "
    "ranks behind and restarts the worker group as a failure (124 when no restart is left); where every rank reports "
    "its steps, the job's pace bounds a wait for a rank sooner: max(8 s, 5 x the slowest rank's median step); 0 turns "
    "the watch off", Number(minimum=0),
    var="TRAINPOD_HANG_TIMEOUT", default=120.0)
STRAGGLER_WINDOW = Setting(
    "straggler_window", "seconds a rank's own work per step (trainpod.train.progress.measure: the bundled examples "
    "call it) must stay at least 1.3 times the other ranks' median before the agent names it a straggler, in its log "
    "and in TRAINPOD_OUTPUT_DIR/stragglers.jsonl (and again when it keeps pace); with the figures' own lag (a median "
    "over 15 s) a rank that turns slow is named within a minute; 0 turns the watch off",
    Number(minimum=0), var="TRAINPOD_STRAGGLER_WINDOW", default=45.0)
REPLACE_STRAGGLERS = Setting(
    "replace_stragglers", "an elastic job's node whose rank the straggler watch names (--straggler-window) leaves the "
    "job while a spare waits (--spares), so that the spare takes its place at the same world size: its ranks stop at "
    "a checkpoint every rank takes (the stop vote), it is excluded from the next rounds and ends with 69",
    Switch(), var="TRAINPOD_REPLACE_STRAGGLERS", default=False)
METRICS_PORT = Setting(
    "metrics_port", "serve this node's metrics for Prometheus at http://<node>:PORT/metrics (the agent's: steps, "
    "samples, step times, restarts, recoveries, hangs, stragglers; docs: Metrics); 0 serves none",
    Integer(0, 65535), var="TRAINPOD_METRICS_PORT", default=0)
HANGS = (HANG_TIMEOUT, STRAGGLER_WINDOW, REPLACE_STRAGGLERS)
OBSERVING = (METRICS_PORT,)

WARM_START = Setting(
    "warm_start", "fork every rank, at the start and at each restart, from one process per node that imported torch "
    "(and the example) once: auto for the bundled examples, on also for a `python SCRIPT` or `python -m MODULE` "
    "command run by this Python, off for neither (trainpod.agent.warm)", Choice(("auto", "on", "off")),
    var="TRAINPOD_WARM_START", default="auto")

IN_PROCESS = "in-process"
RECOVERY = Setting(
    "recovery", "what a rank killed by a signal costs: restart (the agent restarts the whole worker group from the "
    "checkpoint) or in-process (the other ranks keep their processes and re-form the group with a replacement forked "
    "at once, restoring the checkpoint from memory; needs a warm start and a script that uses trainpod.train.inprocess, as "
    "the bundled examples do; trainpod.agent.keeper)", Choice(("restart", IN_PROCESS)), var="TRAINPOD_RECOVERY",
    default="restart")
PEER_COPIES = Setting(
    "peer_copies", "keep the job's newest checkpoint in another node's memory too: after each commit the rank that "
    "wrote it sends it to the next node's agent, and a rank whose checkpoint directory has nothing as new (a node-local "
    "directory, a node that replaces a lost one, a spare) restores from that memory over the network, checked against "
    "its manifest's sha256; costs each node memory for one checkpoint (trainpod.agent.peercopy)", Switch(),
    var="TRAINPOD_PEER_COPIES", default=False)

CONSISTENCY = Setting(
    "consistency", "what a node whose software differs from the others' costs, checked at each rendezvous before any "
    "rank runs (trainpod, Python, torch, CUDA, NCCL, the driver, the installed packages, the script and the local files "
    "it imports: trainpod.agent.consistency): refuse ends the job on every node with one line naming the node, the "
    "field and both values (78); warn prints that line and trains; off compares nothing", Choice(("refuse", "warn", "off")),
    var="TRAINPOD_CONSISTENCY", default="refuse")
NETCHECK = Setting(
    "netcheck", "measure the network at each rendezvous before any rank runs: each link of a ring over the nodes "
    "(round trip, bandwidth) and a gloo all-reduce over the chosen interface, a few seconds (trainpod.agent.netcheck); "
    "one line per job, and a node named below --min-bandwidth: a fixed-size job ends (69), an elastic job goes on without "
    "it", Choice(("off", "on")), var="TRAINPOD_NETCHECK", default="off")
MIN_BANDWIDTH = Setting(
    "min_bandwidth", "Gbit/s every link must carry in the network check; a bound above 0 turns the check on (--netcheck), 0 names "
    "no node for its speed",
    Number(minimum=0), var="TRAINPOD_MIN_BANDWIDTH", default=0.0)
DEVCHECK = Setting(
    "devcheck", "check each local GPU at each rendezvous before any rank runs: a short GEMM and memory copies against "
    "the job's GPUs of the same model, and NVML's ECC, page retirement and Xid errors (trainpod.agent.devcheck); one line "
    "per job, and a node named: a fixed-size job ends (69), an elastic job goes on without it. A host without CUDA "
    "checks nothing and says so", Choice(("off", "on")), var="TRAINPOD_DEVCHECK", default="off")
NODE_CHECKS = (CONSISTENCY, NETCHECK, MIN_BANDWIDTH, DEVCHECK)  # at each rendezvous, before any rank runs (trainpod.agent.policy)

# Read by the ranks (trainpod.train.checkpoint); the launch plan sets it for them. Off, a checkpoint that
# holds more than tensors and plain values is refused (78): its pickle could run any code on load.
TRUST_CHECKPOINTS = Setting(
    "trust_checkpoints", "load checkpoints that hold objects beyond tensors and plain values with the full "
    "unpickler: loading one then runs whatever code it carries, so only for a checkpoint directory that nobody but "
    "your own jobs can write (default: such a checkpoint is refused with 78; trainpod.train.checkpoint)", Boolean(),
    var="TRAINPOD_TRUST_CHECKPOINTS", default=False)
