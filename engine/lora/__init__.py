"""LoRA adapters: reading PEFT directories, the host and device tiers, the batched product, the cluster's list."""
