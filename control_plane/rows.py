"""Decoding the stored rows' JSON objects into the dataclasses they were written from, by whichever version of
the control plane wrote them: a field added since is ignored (logged once per class and field), so that a replica
of the version before takes over, or a rollback starts, on a database the newer one wrote; a field missing takes
its default where the class gives one."""

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


def known_fields(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``data`` that are fields of the dataclass ``cls``."""
    names = {field.name for field in dataclasses.fields(cls)}
    for key in data.keys() - names:
        if (cls.__name__, key) not in _logged:
            _logged.add((cls.__name__, key))
            log.warning("stored %s has a field %r this version does not know (written by a newer one): ignored",
                        cls.__name__, key)
    return {key: value for key, value in data.items() if key in names}
