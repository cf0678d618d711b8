"""Offline tools of the project (run with `python -m tools....`); nothing the appliance imports."""
