"""``pipecast bench surge``: time to first token while a traffic surge scales the pool from zero to N.

Modules, one concern each: ``trace`` (trace files, windows and replay schedules; pure), ``strategies``
(how each strategy provisions its workers; the registry), ``report`` (percentiles, cost, ratios, JSON,
CSV and the text report; pure), ``plots`` (the PNGs), ``loadgen`` (the driver process that runs inside
the emulated cluster: scale-up, replay, health polling) and ``run`` (the orchestration).
"""
