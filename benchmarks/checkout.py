"""Running a benchmark module of this checkout as a child process, from whatever folder ``pipecast bench`` was
started in.

``benchmarks`` is not installed with pipecast: ``pipecast bench`` puts the checkout on its own ``sys.path``
(pipecast/cli.py), which a child does not inherit, so ``python -m benchmarks.X`` finds the module only when
run from the checkout's root.
"""

import sys
from pathlib import Path

#: The source checkout whose ``benchmarks/`` this is.
CHECKOUT = Path(__file__).resolve().parents[1]


def module_argv(module: str, *args: str | Path) -> list[str]:
    """The command line that runs ``python -m module args`` in this interpreter with the checkout first on
    ``sys.path`` (in the command line itself: a child's environment is set by several callers)."""
    boot = (f"import runpy, sys; sys.path.insert(0, {str(CHECKOUT)!r}); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", boot, *map(str, args)]
