"""pdserve gateway: the OpenAI-compatible HTTP front door. Torch-free by design (a test checks it)."""

__version__ = "0.1.0"
