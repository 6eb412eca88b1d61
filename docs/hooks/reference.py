"""The generated parts of the docs: the settings reference and the exit-code table, made from the code.

An mkdocs hook (mkdocs.yml, `hooks:`). A page holds a marker line, which the build replaces:

    <!-- generated: settings -->     every flag of `trainpod run`/`explain`, the cluster sources, the examples'
                                     options and `trainpod job`: flag, variable, default, what it takes, help
    <!-- generated: exit-codes -->   trainpod.contract.EXIT_CODES
    <!-- generated: metrics -->      trainpod.agent.metrics.METRICS: what --metrics-port serves

so neither can drift from the declarations (trainpod.settings and the modules that declare their own).
The build fails when a flag of the CLI (trainpod.launcher.cli.build_parser()) is missing from the reference.

README.md keeps a copy of the exit-code table between `<!-- exit-codes -->` and `<!-- /exit-codes -->`;
tests/unit/test_docs.py fails when it differs from exit_code_table(), and

    python3 docs/hooks/reference.py readme

writes it again.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
# The checkout's package, whatever else is installed.
if str(REPO / "entrypoint") not in sys.path:
    sys.path.insert(0, str(REPO / "entrypoint"))

from trainpod import contract, environments, jobs, settings  # noqa: E402
from trainpod.examples import EXAMPLES  # noqa: E402
from trainpod.launcher import cli  # noqa: E402

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)
README_TABLE = re.compile(r"(<!-- exit-codes -->\n)(.*?)(<!-- /exit-codes -->)", re.DOTALL)


# --- text ----------------------------------------------------------------------------------------

_SPECIAL = re.compile(r"([\\*_\[\]|])")


def text(value: str) -> str:
    """Help text as Markdown: its `code spans` kept, every other character that Markdown would read
    (emphasis, links, a table's |) escaped, < and > as entities (not HTML); argparse's %% is a %."""
    parts = re.split(r"(`[^`]*`)", value.replace("%%", "%"))
    return "".join(part if part.startswith("`") else
                   _SPECIAL.sub(r"\\\1", part).replace("<", "&lt;").replace(">", "&gt;") for part in parts)


def code(value: str) -> str:
    return f"`{value}`" if value else ""


def row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


# --- exit codes ----------------------------------------------------------------------------------


def exit_code_table() -> str:
    """contract.EXIT_CODES as a Markdown table: the docs' and README's."""
    lines = [row(("code", "meaning", "retried?")), row(("---",) * 3)]
    lines += [row((row_.code, text(row_.meaning), text(row_.retried))) for row_ in contract.EXIT_CODES]
    return "\n".join(lines) + "\n"


def readme_table(readme: str) -> str | None:
    """The table README.md holds between its exit-codes markers, or None without them."""
    found = README_TABLE.search(readme)
    return found.group(2) if found else None


# --- metrics -------------------------------------------------------------------------------------


def metrics_table() -> str:
    """trainpod.agent.metrics.METRICS as a Markdown table."""
    from trainpod.agent.metrics import METRICS

    lines = [row(("name", "type", "labels", "what")), row(("---",) * 4)]
    lines += [row((code(m.name), m.kind, ", ".join(code(label) for label in m.labels), text(m.help))) for m in METRICS]
    return "\n".join(lines) + "\n"


# --- settings ------------------------------------------------------------------------------------


def flags(setting: settings.Setting) -> str:
    if isinstance(setting.kind, settings.Switch):
        return code(setting.flag)
    if isinstance(setting.kind, settings.Boolean):
        return f"{code(setting.flag)}, {code('--no-' + setting.flag[2:])}"
    return code(setting.flag)


def default(setting: settings.Setting) -> str:
    value = setting.default
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return code(f"{value:g}")
    return code(str(value))


def table(group: Iterable[settings.Setting], *, flag_column: bool = True) -> str:
    head = ("flag", "variable", "default", "takes", "what") if flag_column else ("variable", "default", "takes", "what")
    lines = [row(head), row(("---",) * len(head))]
    for setting in group:
        cells = [code(setting.var or ""), default(setting), text(setting.kind.expected()), text(setting.help)]
        lines.append(row([flags(setting), *cells] if flag_column else cells))
    return "\n".join(lines) + "\n"


# `trainpod run` and `trainpod explain`, in the order of their --help.
RUNNING = (settings.CONNECT_TIMEOUT, *settings.SUPERVISION, *settings.HANGS, *settings.OBSERVING, settings.WARM_START,
           settings.RECOVERY, settings.PEER_COPIES,
           settings.TRUST_CHECKPOINTS, *settings.NODE_CHECKS)


def run_sections() -> Iterator[tuple[str, str, tuple[settings.Setting, ...]]]:
    """(heading, one line about it, settings) for `trainpod run` and `explain`."""
    yield ("Topology", "Each overrides what the cluster's environment says; the source is chosen first.",
           (environments.SOURCE, *settings.TOPOLOGY))
    for cls in environments.REGISTRY.values():
        if cls.settings:
            yield (f"Source `{cls.name}`", f"What it reads: {text(cls.description)}.", tuple(cls.settings))
    yield ("What to run", "An example by name, or your own command after `--`.", (cli.EXAMPLE,))
    yield ("Running", "Supervision, restarts, hangs, stragglers, metrics, warm starts, recovery, checkpoints and the nodes' "
           "checks.", RUNNING)


def example_sections() -> Iterator[tuple[str, str, tuple[settings.Setting, ...]]]:
    """The bundled examples' options: the harness's common ones, then each example's own and its defaults."""
    from trainpod.examples.options import COMMON

    yield ("Every example", "The options every example has (`trainpod.examples.options.COMMON`), with their defaults; "
           "`trainpod run` checks them before anything starts.", tuple(COMMON))
    common = {s.name: s for s in COMMON}
    for name, example in EXAMPLES.items():
        recipe = importlib.import_module(example.module).RECIPE  # its default changes: imports torch
        changed = tuple(s for s in recipe.settings() if s.name in common and s.default != common[s.name].default)
        own = tuple(recipe.options)
        about = text(example.description) + "."
        if changed:
            about += " Defaults it changes: " + ", ".join(f"{code(s.flag)} {default(s) or 'none'}" for s in changed) + "."
        yield (f"`{name}`", about, own)


def job_sections() -> Iterator[tuple[str, str, tuple[settings.Setting, ...]]]:
    yield ("Every scheduler", "`trainpod job SCHEDULER NAME [flags] [-- the example's own flags]`.", tuple(jobs.SETTINGS))
    for cls in jobs.REGISTRY.values():
        if cls.settings:
            yield (f"`trainpod job {cls.name}`", f"What it makes: {text(cls.description)}.", tuple(cls.settings))


def section(level: str, sections: Iterable[tuple[str, str, tuple[settings.Setting, ...]]]) -> list[str]:
    out = []
    for heading, about, group in sections:
        out += [f"{level} {heading}", "", about, ""]
        out += [table(group), ""] if group else ["It has no options of its own.", ""]
    return out


def settings_reference() -> str:
    out = ["## `trainpod run` and `trainpod explain`", "",
           "`trainpod run --help` prints the same flags; `explain` takes them all, to show what `run` would do.", ""]
    out += section("###", run_sections())
    out += ["### Variable only", "",
            "A password has no flag: a flag's value shows in `ps` and in job files.", "",
            table((settings.ETCD_PASSWORD,), flag_column=False), "",
            "### `trainpod explain` only", "", table(cli.EXPLAIN), ""]
    out += ["## The examples' options", "",
            "After `--`: `trainpod run --example NAME -- --epochs 5`; `trainpod run --example NAME -- --help` lists them.", ""]
    out += section("###", example_sections())
    out += ["## `trainpod job`", "", "`trainpod job SCHEDULER --help` lists the same.", ""]
    out += section("###", job_sections())
    return "\n".join(out)


def missing_flags() -> list[str]:
    """The CLI's flags (run, explain, job SCHEDULER) that the reference leaves out: 'run --x'."""
    documented = {
        "run": {s.flag for _, _, group in run_sections() for s in group},
        "job": {s.flag for _, _, group in job_sections() for s in group},
    }
    documented["explain"] = documented["run"] | {setting.flag for setting in cli.EXPLAIN}
    missing = []
    for command, parser in _subparsers(cli.build_parser()):
        known = documented[command.split()[0]]
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option not in ("--help", "--version") and option not in known \
                        and not (option.startswith("--no-") and "--" + option[5:] in known):
                    missing.append(f"{command} {option}")
    return missing


def _subparsers(parser, prefix: str = "") -> Iterator[tuple[str, object]]:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                command = f"{prefix} {name}".strip()
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from _subparsers(sub, command)
                elif command in ("run", "explain") or command.startswith("job "):
                    yield command, sub


# --- the hook ------------------------------------------------------------------------------------

GENERATORS = {"settings": settings_reference, "exit-codes": exit_code_table, "metrics": metrics_table}


def on_pre_build(config, **kwargs) -> None:
    missing = missing_flags()
    if missing:
        from mkdocs.exceptions import PluginError

        raise PluginError("docs/hooks/reference.py: the settings reference leaves out " + ", ".join(missing)
                          + ": add their declarations to run_sections() or job_sections()")


def on_page_markdown(markdown: str, page, config, files) -> str:
    def generate(found: re.Match) -> str:
        name = found.group(1)
        if name not in GENERATORS:
            from mkdocs.exceptions import PluginError

            raise PluginError(f"{page.file.src_path}: no generator for <!-- generated: {name} -->")
        return GENERATORS[name]()

    return MARKER.sub(generate, markdown)


def main(argv: list[str]) -> int:
    if argv != ["readme"]:
        print(__doc__, file=sys.stderr)
        return 64
    readme = README.read_text()
    if readme_table(readme) is None:
        print("reference.py: README.md has no <!-- exit-codes --> ... <!-- /exit-codes --> markers", file=sys.stderr)
        return 1
    README.write_text(README_TABLE.sub(lambda m: m.group(1) + exit_code_table() + m.group(3), readme))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
