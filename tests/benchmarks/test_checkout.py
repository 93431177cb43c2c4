"""Benchmarks start their own modules as children through one helper that works from any folder."""

import re

from tests.support import REPO


def test_no_benchmark_starts_one_of_its_modules_with_a_bare_python_m():
    """Finding 1: `python -m benchmarks.X` finds the module only from the checkout's root, but `pipecast bench`
    runs from any folder; benchmarks.checkout.module_argv puts the checkout on the child's sys.path."""
    bare = re.compile(r"""["']-m["'],\s*["']benchmarks\.""")
    offenders = [str(p.relative_to(REPO)) for p in sorted((REPO / "benchmarks").rglob("*.py"))
                 if bare.search(p.read_text())]
    assert offenders == []
