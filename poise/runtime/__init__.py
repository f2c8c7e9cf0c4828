"""What one rank does: process-group set-up, step clocks, the training step, and the worker entry point."""
