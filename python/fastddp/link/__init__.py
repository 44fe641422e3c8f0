"""The link between ranks: ``Link``, a link as its bus bandwidth and latency, and what a
collective costs on it (model.py, Note [collective cost]); ``EmulatedLinkGroup``, a process
group whose collectives take as long as that link would make them (emulator.py)."""

from fastddp.link.emulator import EmulatedLinkGroup
from fastddp.link.model import Link, bus_factor, parse_link

__all__ = ["EmulatedLinkGroup", "Link", "bus_factor", "parse_link"]
