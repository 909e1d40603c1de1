"""What every benchmark shares: workloads, the streaming client, metrics, process samples, the launcher."""
