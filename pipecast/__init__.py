"""pipecast: get new LLM serving workers to their first token fast.

The package is kept light to import: the CLI and the packager import it, so heavy pieces (torch, the
engine) load only when used, e.g. through :func:`pipecast.load`.
"""

__version__ = "0.1.0"
