"""What the tests share: launching worker processes, in-memory transports, the fault proxy, the workers' bodies."""
