"""The README stays true to the code: every setting and every CLI command is documented."""


from pipecast.cli import COMMANDS
from pipecast.core.settings import Settings
from tests.support import REPO

README = (REPO / "README.md").read_text()


def test_every_setting_is_in_the_readme_table():
    missing = [name for name in Settings.model_fields if f"| `{name}` | `PIPECAST_{name.upper()}` |" not in README]
    assert not missing, f"settings missing from the README's configuration table: {missing}"


def test_every_command_is_mentioned():
    missing = [name for name in COMMANDS if f"pipecast {name}" not in README]
    assert not missing, f"commands the README never shows: {missing}"
