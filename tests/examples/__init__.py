"""Examples tier: the example scripts and README commands, run as written."""
