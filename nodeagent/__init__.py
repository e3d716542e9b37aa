"""The node agent: one per host; launches, watches and stops the workers of job rounds."""
