"""testbed: emulated inter-datacenter WANs for measuring geo-distributed model synchronisation."""

__version__ = "0.1.0"
