"""KV transfer: bandwidth per transport against raw ceilings, and P/D parity on one machine."""
