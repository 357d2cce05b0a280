"""Collectives between ranks: the process groups, all-gathers and reduce-scatters on host or device
(comm.py), and the watchdog that names a stalled collective, its unit and the rank behind (watchdog.py)."""
