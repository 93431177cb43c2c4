"""The serving worker, ``pipecast serve``: an OpenAI-compatible HTTP API over the execute-while-load engine.

Modules, one concern each (import them directly; this package imports nothing so the CLI stays light):

- ``openai_api``: checking completion requests and building response bodies (pure);
- ``text``: the package's tokenizer, incremental detokenization, stop strings;
- ``health``: the ``GET /health`` answer, written here and read by the router;
- ``worker``: the model's loading, health and admission control, and one completion's pieces;
- ``metrics``: the Prometheus metrics;
- ``app``: the aiohttp server and its graceful shutdown;
- ``command``: the click command.
"""
