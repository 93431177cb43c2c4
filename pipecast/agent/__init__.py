"""The node agent's data plane: block store, transports, peer serving, fetching and the local engine API.

Import the pieces from their modules (``pipecast.agent.store``, ``pipecast.agent.fetcher``, ...); this
package imports nothing itself so the CLI stays light.
"""
