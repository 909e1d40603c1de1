"""The model: config, checkpoint loader, decoder layers, rotary embedding, CPU linear forms, fused decode step."""
