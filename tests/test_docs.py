"""The README stays true to the code: every setting (with its default) and every CLI command is documented, and
the command lines it shows name commands and options that exist."""


import re

import yaml

from pipecast.cli import COMMANDS
from pipecast.core.settings import Settings
from tests.support import REPO

README = (REPO / "README.md").read_text()


def test_every_setting_is_in_the_readme_table():
    missing = [name for name in Settings.model_fields if f"| `{name}` | `PIPECAST_{name.upper()}` |" not in README]
    assert not missing, f"settings missing from the README's configuration table: {missing}"


def test_the_settings_table_gives_each_default_and_names_only_settings():
    rows = re.findall(r"^\| `(\w+)` \| `PIPECAST_\w+` \| ([^|]+) \|", README, flags=re.M)
    assert len(rows) >= len(Settings.model_fields)
    wrong = []
    for name, shown in rows:
        field = Settings.model_fields.get(name)
        if field is None:
            wrong.append(f"{name}: no such setting")
            continue
        default = field.get_default(call_default_factory=True)
        shown = shown.strip()
        if shown == "unset":
            right = default is None
        elif shown == "empty":
            right = default is not None and not default and not isinstance(default, (bool, int, float))
        else:
            right = shown == f"`{default}`"
        if not right:
            wrong.append(f"{name}: README says {shown}, the default is {default!r}")
    assert not wrong, "the README's settings table is out of date:\n" + "\n".join(wrong)


def _leaves(values: dict, prefix: str = "") -> list[str]:
    """The dotted names of the leaves of a values map (a map it holds, such as a nodeSelector, by its keys too)."""
    return [leaf for key, value in values.items()
            for leaf in (_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [prefix + key])]


def _values_table_names() -> list[str]:
    """The values the README's table of the Helm chart's values names in its first column: `.x` is a sibling of
    the name before it, `*` any one key."""
    table = README[README.index("| value | default | what the operator sets |"):].split("\n\n", 1)[0]
    names: list[str] = []
    for row in table.splitlines()[2:]:
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            names.append(names[-1].rsplit(".", 1)[0] + name if name.startswith(".") else name)
    return names


def test_every_chart_value_is_in_the_readme_values_table():
    """Found in review: about 20 values of values.yaml were in no row (router.apiKeysKey, the ports, ...). A row
    naming a map covers its keys (`agent.nodeSelector`, `*.resources`)."""
    leaves = _leaves(yaml.safe_load((REPO / "deploy/helm/pipecast/values.yaml").read_text()))
    patterns = {name: re.compile(re.escape(name).replace(r"\*", r"[^.]+") + r"(\..+)?")
                for name in _values_table_names()}
    missing = [leaf for leaf in leaves if not any(p.fullmatch(leaf) for p in patterns.values())]
    assert not missing, f"values missing from the README's table of the chart's values: {missing}"
    unknown = [name for name, p in patterns.items() if not any(p.fullmatch(leaf) for leaf in leaves)]
    assert not unknown, f"the README's table of the chart's values names values values.yaml lacks: {unknown}"


def test_every_command_is_mentioned():
    missing = [name for name in COMMANDS if f"pipecast {name}" not in README]
    assert not missing, f"commands the README never shows: {missing}"


# -- the README's command lines name commands and options that exist ----------------------------------------

SHELL_BLOCKS = ("sh", "bash", "ini")
# Where a command ends on a shell line: these words, or a word holding one of SEPARATOR_CHARS (`$(...)`, quotes).
SEPARATORS = {";", "&&", "||", "|", "#", "<", ">"}
SEPARATOR_CHARS = ('"', ")", "'")
WORD = re.compile(r"[a-z][a-z0-9-]*")


def _shell_lines(text: str) -> list[str]:
    """The lines of the README's shell code blocks, continuations (a trailing backslash) joined."""
    lines, block, pending = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
            continue
        if block in SHELL_BLOCKS:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            lines.append(pending + line)
            pending = ""
    return lines


def _commands(line: str, known_only: bool) -> list[list[str]]:
    """Every ``pipecast WORD ...`` command in ``line``: its words up to the end of the command. With
    ``known_only``, only those whose WORD is a pipecast command (prose in inline code may say "pipecast x")."""
    found = []
    words = line.split()
    for i, word in enumerate(words[:-1]):
        if word.rsplit("/", 1)[-1].lstrip("$(") != "pipecast" or not WORD.fullmatch(words[i + 1]):
            continue
        if known_only and words[i + 1] not in COMMANDS:
            continue
        command, depth = [], 0
        for w in words[i + 1:]:
            depth += w.count("[") - w.count("]")
            if (w in SEPARATORS and not (w == "|" and depth > 0)) or w.startswith("#"):
                break
            cut = min((w.index(c) for c in SEPARATOR_CHARS if c in w), default=None)
            if cut is not None:
                if w[:cut]:
                    command.append(w[:cut])
                break
            command.append(w)
        found.append(command)
    return found


def _check_command(words: list[str]) -> list[str]:
    """What is wrong with one command line's words: an unknown command or subcommand, an unknown option."""
    import click

    from pipecast.cli import cli

    ctx = click.Context(cli)
    command: click.Command = cli
    allowed = {o for p in cli.params for o in p.opts + p.secondary_opts}
    takes_value: set[str] = set()
    path = ["pipecast"]
    skip = False
    problems = []
    for word in words:
        if skip:
            skip = False
            continue
        if word.strip("[]").startswith("-"):
            option = word.strip("[]").split("=")[0]
            # "--flag/--no-flag" names both forms of a boolean flag
            problems += [f"`{' '.join(path)}` has no option {form}" for form in option.split("/")
                         if form not in allowed | {"--help", "-h"}]
            skip = option in takes_value and "=" not in word
            continue
        if isinstance(command, click.Group) and WORD.fullmatch(word):
            sub = command.get_command(ctx, word)
            if sub is None:
                problems.append(f"`{' '.join(path)}` has no subcommand {word!r}")
                break
            command, path = sub, path + [word]
            allowed |= {o for p in command.params for o in p.opts + p.secondary_opts}
            takes_value |= {o for p in command.params if isinstance(p, click.Option) and not p.is_flag
                            and not p.count for o in p.opts}
    return problems


def test_every_command_line_in_the_readme_names_real_commands_and_options():
    lines = [(line, False) for line in _shell_lines(README)]
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    lines += [(span, True) for span in re.findall(r"`([^`\n]*pipecast [^`\n]*)`", prose)]
    checked, problems = 0, []
    for line, known_only in lines:
        for words in _commands(line, known_only):
            checked += 1
            problems += [f"{p} (README: {line.strip()!r})" for p in _check_command(words)]
    assert checked > 50, f"only {checked} command lines found: the README's layout changed?"
    assert not problems, "\n".join(problems)


def test_the_command_line_check_finds_what_does_not_exist():
    assert _check_command(["cp", "deploy", "PKG", "--min", "0", "--no-such-option", "1"]) == [
        "`pipecast cp deploy` has no option --no-such-option"]
    assert _check_command(["cp", "no-such-command"]) == ["`pipecast cp` has no subcommand 'no-such-command'"]
    assert _commands("x | pipecast pack SRC OUT [--a N | --b 1] # note", False) == [
        ["pack", "SRC", "OUT", "[--a", "N", "|", "--b", "1]"]]
    assert _commands('curl -H "K: $(pipecast cp serving-key)" url', False) == [["cp", "serving-key"]]


def test_the_readmes_static_plan_example_is_a_plan_file_the_agent_reads(tmp_path):
    from pipecast.agent.plan_file import read_plan_file

    example = re.search(r"```json\n(\{\"package_id\".*?)```", README, re.S).group(1)
    path = tmp_path / "plan.json"
    path.write_text(example.replace("<64 hex>", "0" * 64))
    plan = read_plan_file(path)
    assert set(plan.nodes) == {"seed", *plan.plan.assignments} and plan.plan.sources == ("seed",)
