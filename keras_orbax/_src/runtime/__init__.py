"""The process keras-orbax runs in: JAX processes and their agreement, the garbage collector, log
lines and progress on a terminal."""
