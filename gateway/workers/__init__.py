"""The worker side: the backend interface, the ZeroMQ backend, registry, router, admission.

Imports nothing from http/ or dialects/."""
