"""pipecast: get new LLM serving workers to their first token fast.

The package is kept light to import: the CLI and the packager import it, so heavy pieces (torch, the
engine) load only when used, e.g. through :func:`pipecast.load`.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``pipecast.load`` is imported on first use: it pulls in the engine (torch, transformers).
    if name == "load":
        from pipecast.loading import load

        return load
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
