"""The pure planners: the plan value, multicast schedules, re-planning after failures, the fluid simulator.

Functions of state to a plan: no sockets, no clock, no I/O; the control plane, the agents' static
plans and the benchmarks all call them.
"""
