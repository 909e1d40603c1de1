"""One scheduled step run: its attention metadata, the model forward, the sample."""
