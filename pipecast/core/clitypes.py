"""Command-line parameter types shared by pipecast's commands."""

import math
from typing import Any

import click


class Number(click.FloatRange):
    """A :class:`click.FloatRange` that also refuses nan and infinities: nan passes every bound (each comparison
    with it is false) and an infinite timeout or rate is no deadline or no limit, which no option means; both would
    be taken silently (a router given ``--queue-timeout nan`` never answered a queued request)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class SettingPath(click.Path):
    """A :class:`click.Path` of an option that backs a setting: an empty value is None, the setting left unset, as
    an empty ``PIPECAST_*`` variable leaves it. A plain click.Path made it ``Path("")``, the working directory,
    before the settings' own empty-is-unset check could see it (``--cache-dir ""`` cached in the working folder,
    and made room there by removing its package-id-named folders)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == "":
            return None
        return super().convert(value, param, ctx)
