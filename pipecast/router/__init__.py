"""The request router: one OpenAI-compatible endpoint in front of many serving workers.

It queues requests while no worker can take them, sends each to the least-loaded worker that is
``ready`` or ``partial`` (execute-while-load), streams answers back chunk by chunk, and retries on
another worker when one dies before answering. See :mod:`pipecast.router.app` for the HTTP surface.
"""
