"""The scaling daemon (``pipecast scaler``): keeps each deployment's replicas by its SLO signals.

:mod:`pipecast.scaler.policy` decides (pure); :mod:`pipecast.scaler.daemon` reads the routers' ``/stats``
and the control plane every tick, asks the policy, records the decision in the control plane's audit
trail and acts through the control plane's API.
"""
