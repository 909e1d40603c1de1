"""The systems pdserve is measured against: llama.cpp's llama-server (built, converted, swept) and transformers."""
