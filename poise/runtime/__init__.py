"""What one rank does: process-group set-up, the training step, and the worker entry point."""
