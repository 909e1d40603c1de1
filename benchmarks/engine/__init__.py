"""The offline engine: throughput against transformers, a step's profile, LoRA overhead, their roofline."""
