"""The prepared GPU run (`scripts/gpu-check`) and the Triton kernel benchmark."""
