"""Transports that move blocks between agents; :mod:`.registry` picks one, :mod:`.base` is the interface."""
