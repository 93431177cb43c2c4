"""The execute-while-load engine: a decoder-only model that runs layer i as soon as its tensors are bound.

Modules, one concern each (import them directly; this package imports nothing so the CLI stays light):

- ``providers``: where blocks come from (package folder, node agent, a delayed provider for tests);
- ``architectures``: which Hugging Face model types are supported and how their skeleton is built;
- ``weights``: binding a block's tensors to the skeleton's parameters (zero-copy on CPU);
- ``progressive``: the layer-wise model (embed, one layer, head) and its readiness;
- ``loader``: the background thread that binds blocks as they arrive;
- ``kv_cache``, ``sampling``, ``batching``: the KV cache, token sampling, the step scheduler;
- ``streams``: delivering tokens from the engine thread to sync or asyncio consumers;
- ``engine``: the public :class:`~pipecast.engine.engine.Engine`;
- ``memory``: RSS measurement (the throughput benchmark is ``benchmarks/engine_bench.py``).
"""
